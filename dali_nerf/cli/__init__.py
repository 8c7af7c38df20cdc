"""The ``dali-nerf`` command (``main``) and its subcommands: ``demo``, ``validate``, ``render``, the
trainers' command line (``trainer``) and the one-line error handling all of them share
(``command``)."""
