"""``python -m jaxdecode generate ...``: the ``jaxdecode`` console script (``cli.main``)."""

from jaxdecode.cli import main

raise SystemExit(main())
