"""``python -m trl_ppomax.cli``: the ``trl-ppomax`` command."""

from trl_ppomax.cli import main

raise SystemExit(main())
