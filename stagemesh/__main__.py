import sys

from stagemesh.cli import run

sys.exit(run())
