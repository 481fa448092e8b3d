"""The unit tier: no root, no kernel; pure code against fake /proc, map
contents, loopback servers and real chdb."""
