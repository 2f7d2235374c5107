"""Exit at once with code argv[1]."""

import sys

from common import say

say("exiting")
sys.exit(int(sys.argv[1]))
