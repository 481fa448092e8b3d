import sys

from spanlet.demo.standin import main

main(sys.argv[1:])
