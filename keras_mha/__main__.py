"""`python -m keras_mha ...`: the same as the `keras-mha` console script."""

import sys

from keras_mha.cli import main

sys.exit(main())
