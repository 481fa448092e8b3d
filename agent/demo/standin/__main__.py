import sys

from agent.demo.standin import main

main(sys.argv[1:])
