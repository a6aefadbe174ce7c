"""Synthetic ImageNet-shaped images for ResNet-50 runs, made on demand from their index."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..core.errors import UserError

IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
IMAGENET_STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


class SyntheticImages:
    """ImageNet-shaped synthetic data for ResNet-50: ``n`` images, (3,H,W), ``classes`` labels.

    Image ``i`` is generated from ``default_rng([seed, i])`` alone (random 8-bit pixels,
    normalised with the ImageNet mean/std), so any rank reads the same image for the same
    index. ``read(idx)`` returns x float32 (k,3,H,W) and labels int64 (k,).
    """

    def __init__(self, n: int, image_size: int = 224, classes: int = 1000, seed: int = 0) -> None:
        if n < 1 or image_size < 1 or classes < 1:
            raise UserError(f"bad synthetic image set: n={n}, image_size={image_size}, "
                            f"classes={classes}", "all must be positive")
        self.total = int(n)
        self.image_size = int(image_size)
        self.classes = int(classes)
        self.seed = int(seed)

    def __len__(self) -> int:
        return self.total

    def read(self, indices: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        g = np.asarray(indices, dtype=np.int64).reshape(-1)
        if g.size and (g.min() < 0 or g.max() >= self.total):
            raise IndexError(f"image index out of range 0..{self.total - 1}")
        s = self.image_size
        x = np.empty((g.size, 3, s, s), dtype=np.float32)
        y = np.empty(g.size, dtype=np.int64)
        scale = (1.0 / (255.0 * IMAGENET_STD))[:, None, None]
        shift = (IMAGENET_MEAN / IMAGENET_STD)[:, None, None]
        for k, idx in enumerate(g):
            rng = np.random.default_rng([self.seed, int(idx)])
            y[k] = rng.integers(self.classes)
            pixels = rng.integers(0, 256, size=(3, s, s), dtype=np.uint8)
            np.multiply(pixels, scale, out=x[k], casting="unsafe")
            x[k] -= shift
        return x, y
