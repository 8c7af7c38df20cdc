import sys

from dali_nerf.cli.main import main

sys.exit(main())
