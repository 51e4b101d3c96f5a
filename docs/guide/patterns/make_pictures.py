"""Draws the block maps of docs/guide/attention-patterns.md: one PNG per pattern, next
to this script (T = S = 1024, blocks of 64: white empty, orange partial, blue full).

    .venv/bin/python docs/guide/patterns/make_pictures.py
"""

import os
import sys

os.environ.setdefault("KERAS_BACKEND", "numpy")  # the pictures need no accelerator

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "benchmarks"))
import block_mask as patterns  # noqa: E402  (benchmarks/block_mask.py: the same patterns)

from keras_mha import block_mask  # noqa: E402

LENGTH, BLOCK = 1024, 64
COLORS = ListedColormap(["#ffffff", "#f5a623", "#2d6cdf"])  # empty, partial, full


def slug(name):
    return name.lower().replace(" ", "-").replace("+", "-").replace("--", "-")


def main():
    for name in patterns.PATTERNS:
        mod = patterns.mask_mod(name, LENGTH)
        built = block_mask.create_block_mask(mod, None, None, LENGTH, LENGTH, BLOCK)
        fig, ax = plt.subplots(figsize=(3, 3))
        ax.imshow(built.kinds[0, 0], cmap=COLORS, vmin=0, vmax=2)
        ax.set_title(f"{name}: density {built.density:.2f}", fontsize=9)
        ax.set_xlabel("key block")
        ax.set_ylabel("query block")
        ax.set_xticks([])
        ax.set_yticks([])
        fig.tight_layout()
        fig.savefig(os.path.join(HERE, f"{slug(name)}.png"), dpi=80)
        plt.close(fig)
        print(name, f"{built.density:.3f}")


if __name__ == "__main__":
    main()
