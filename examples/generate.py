"""Generate text with jaxdecode from the command line.

    python examples/generate.py                       # embedded random-weight model, greedy
    python examples/generate.py --stream --max-new-tokens 64
    python examples/generate.py --checkpoint DIR --prompt "Hello" --chat \\
        --temperature 0.7 --top-p 0.9 --num-samples 4

Same options as ``jaxdecode generate`` (``--help`` lists them); the code is in
``jaxdecode/cli.py`` and ``jaxdecode/generation.py``.
"""

import sys

from jaxdecode.cli import generate_main

if __name__ == "__main__":
    sys.exit(generate_main(sys.argv[1:], prog="generate.py"))
