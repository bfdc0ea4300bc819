#!/usr/bin/env python3
"""Draws the block-sparse patterns of flashcute.masks into docs/masks/<name>.png.

    python scripts/draw_masks.py [--out docs/masks]

Every picture is the block grid of one pattern at seqlen 2048 with 128 x 128 blocks (16 x 16
blocks; a rectangular one for sliding_window with seqlen_q != seqlen_k): dark = computed
block, light = skipped. sliding_window_causal is drawn per element (8 x 8 tokens a pixel) to
show how causal=True masks inside the kept blocks. docs/MASKS.md shows the pictures.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
import torch  # noqa: E402

from flashcute import masks  # noqa: E402

SEQLEN, BLOCK = 2048, (128, 128)
SKIPPED, MASKED, KEPT = "#eef1f5", "#9ecae1", "#08519c"

# name -> (mask, caption)
PATTERNS = {
    "random_blocks": (lambda: masks.random_blocks(SEQLEN, density=0.25, block_size=BLOCK, seed=0),
                      "random_blocks(density=0.25)"),
    "sliding_window": (lambda: masks.sliding_window(SEQLEN, window=256, block_size=BLOCK),
                       "sliding_window(window=256)"),
    "sliding_window_rect": (lambda: masks.sliding_window(1024, SEQLEN, window=256, block_size=BLOCK),
                            "sliding_window(1024, 2048, window=256)"),
    "longformer": (lambda: masks.longformer(SEQLEN, window=256, global_tokens=128, block_size=BLOCK),
                   "longformer(window=256, global_tokens=128)"),
    "bigbird": (lambda: masks.bigbird(SEQLEN, window=128, global_tokens=128, random_blocks=2,
                                      block_size=BLOCK, seed=0),
                "bigbird(window=128, global_tokens=128,\nrandom_blocks=2)"),
    "butterfly": (lambda: masks.butterfly(SEQLEN, block_size=BLOCK), "butterfly()"),
}


def _axes(n_q: int, n_kv: int, title: str):
    fig, ax = plt.subplots(figsize=(3.4 * max(1.0, n_kv / n_q) ** 0.5, 3.6), dpi=100)
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("key block j", fontsize=8)
    ax.set_ylabel("query block i", fontsize=8)
    ax.set_xticks(range(0, n_kv, 4))
    ax.set_yticks(range(0, n_q, 4))
    ax.tick_params(labelsize=7, length=2)
    # Block grid lines.
    ax.set_xticks([x - 0.5 for x in range(n_kv + 1)], minor=True)
    ax.set_yticks([y - 0.5 for y in range(n_q + 1)], minor=True)
    ax.grid(which="minor", color="white", linewidth=0.6)
    ax.tick_params(which="minor", length=0)
    return fig, ax


def draw_blocks(mask, caption: str, path: Path) -> None:
    blocks = mask.to_block_dense()[0, 0].int()
    n_q, n_kv = blocks.shape
    title = f"{caption}\ndensity {mask.density():.2f}"
    fig, ax = _axes(n_q, n_kv, title)
    ax.imshow(blocks.numpy(), cmap=ListedColormap([SKIPPED, KEPT]), vmin=0, vmax=1,
              interpolation="nearest")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def draw_causal_window(path: Path, window: int = 256, stride: int = 8) -> None:
    """sliding_window + causal=True, per element: skipped / computed but masked / attended."""
    mask = masks.sliding_window(SEQLEN, window=window, block_size=BLOCK)
    dense = mask.to_dense()[0, 0]
    causal = torch.ones(SEQLEN, SEQLEN, dtype=torch.bool).tril()
    band = dense & causal & ~torch.ones_like(causal).tril(-window - 1)
    level = dense.int() + band.int()  # 0 skipped, 1 computed but masked, 2 attended
    n = SEQLEN // BLOCK[0]
    fig, ax = _axes(n, n, f"sliding_window(window={window}) + causal=True\nper element")
    ax.imshow(level[::stride, ::stride].numpy(), cmap=ListedColormap([SKIPPED, MASKED, KEPT]),
              vmin=0, vmax=2, interpolation="nearest", extent=(-0.5, n - 0.5, n - 0.5, -0.5))
    handles = [Patch(color=KEPT, label="attended"), Patch(color=MASKED, label="masked in a kept block"),
               Patch(color=SKIPPED, label="skipped block")]
    ax.legend(handles=handles, loc="lower left", fontsize=6, framealpha=0.9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "docs" / "masks")
    out = parser.parse_args().out
    out.mkdir(parents=True, exist_ok=True)
    for name, (make, caption) in PATTERNS.items():
        draw_blocks(make(), caption, out / f"{name}.png")
        print(out / f"{name}.png")
    draw_causal_window(out / "sliding_window_causal.png")
    print(out / "sliding_window_causal.png")


if __name__ == "__main__":
    main()
