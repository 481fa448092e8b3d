"""A tiny random Llama and a tokenizer trained here, for real vLLM in tests:
nothing from any hub. Run with the vLLM environment's Python:

    python vllm_tiny_model.py OUT_DIR

Head size 32 (the CPU attention backend's least), 2 layers, a 512-token
vocabulary trained on a few lines of text; weights from a fixed seed."""

from __future__ import annotations

import sys
from pathlib import Path

TEXT = [
    "the quick brown fox jumps over the lazy dog",
    "a picture of a cat sitting on a mat in the sun",
    "spoken words turned into text by a model on a node",
    "frames of a video decoded and sent to the engine",
    "one two three four five six seven eight nine ten",
] * 50


def make(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXT, trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    fast.save_pretrained(out)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=32,
                      max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                      tie_word_embeddings=False, torch_dtype="float32")
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(out)


if __name__ == "__main__":
    make(Path(sys.argv[1]))
