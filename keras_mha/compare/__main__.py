"""`python -m keras_mha.compare SPEC`: a worker process (see `workers`)."""

import sys

from keras_mha.compare.workers import _worker

if __name__ == "__main__":
    _worker(sys.argv[1])
