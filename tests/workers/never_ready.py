"""Never sends READY=1."""

from common import forever, say

say("started")
forever()
