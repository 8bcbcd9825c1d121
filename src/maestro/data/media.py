"""Images and audio features referenced by a record: ``.npy``/``.npz`` arrays or image files.

An image becomes ``pixel_values`` of shape ``(C, H, W)`` (float32) as ``ImageSpec`` says: an
array already of that shape is taken as is (preprocessed); an ``(H, W, C)`` or ``(H, W)`` uint8
array, or an image file Pillow decodes (PNG, JPEG, ...), is resized (bilinear) to ``size``,
scaled to [0, 1] and normalised per channel with ``mean``/``std``. Audio features are arrays
only (``(mel_bins, frames)``, e.g. Whisper's log-mel ``input_features``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

ARRAY_SUFFIXES = (".npy", ".npz")
#: keys an ``.npz`` file's array is looked up by (else its only array)
NPZ_KEYS = ("pixel_values", "image", "input_features", "audio", "arr_0")


@dataclass(frozen=True)
class ImageSpec:
    """What an encoder's ``pixel_values`` look like (e.g. ``vision_tower(...).image_spec``)."""

    size: tuple[int, int] = (224, 224)
    """Height and width after resizing."""
    channels: int = 3
    """3 (RGB) or 1 (grey)."""
    mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    """Per-channel mean subtracted after scaling to [0, 1] (SigLIP: 0.5)."""
    std: tuple[float, ...] = (0.5, 0.5, 0.5)
    """Per-channel standard deviation divided by (SigLIP: 0.5)."""

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(C, H, W)`` of the pixel values."""
        return (self.channels, *self.size)


def read_array(path: Path) -> np.ndarray:
    """The array in a ``.npy`` file, or in a ``.npz`` file (key ``pixel_values``, ``image``,
    ... or its only array)."""
    if path.suffix == ".npy":
        return np.load(path, allow_pickle=False)
    with np.load(path, allow_pickle=False) as z:
        for k in NPZ_KEYS:
            if k in z.files:
                return z[k]
        if len(z.files) == 1:
            return z[z.files[0]]
        raise ValueError(f"has arrays {z.files}; name one of them {NPZ_KEYS[0]!r}")


def load_image(path: Path, spec: ImageSpec) -> torch.Tensor:
    """``(C, H, W)`` float32 pixel values of an image file or array (see the module doc)."""
    from PIL import Image

    if path.suffix in ARRAY_SUFFIXES:
        a = read_array(path)
        if tuple(a.shape) == spec.shape and np.issubdtype(a.dtype, np.floating):
            return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))
        ok = a.dtype == np.uint8 and (a.ndim == 2 or (a.ndim == 3 and a.shape[2] in (1, 3, 4)))
        if not ok:
            raise ValueError(
                f"array of shape {tuple(a.shape)} and dtype {a.dtype} is neither pixel values "
                f"{spec.shape} (float) nor an (H, W, C) uint8 image"
            )
        img = Image.fromarray(a[..., 0] if a.ndim == 3 and a.shape[2] == 1 else a)
    else:
        img = Image.open(path)
        img.load()
    img = img.convert("RGB" if spec.channels == 3 else "L")
    h, w = spec.size
    img = img.resize((w, h), Image.BILINEAR)
    x = np.asarray(img, dtype=np.float32) / 255.0
    if x.ndim == 2:
        x = x[:, :, None]
    x = (x - np.asarray(spec.mean, np.float32)) / np.asarray(spec.std, np.float32)
    return torch.from_numpy(np.ascontiguousarray(x.transpose(2, 0, 1)))  # (C, H, W)


def load_features(path: Path, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """A float32 feature array (``.npy``/``.npz``), checked against ``shape`` if given."""
    if path.suffix not in ARRAY_SUFFIXES:
        raise ValueError(f"audio features must be .npy or .npz, got {path.suffix or 'no suffix'}")
    a = read_array(path)
    if shape is not None and tuple(a.shape) != tuple(shape):
        raise ValueError(f"array of shape {tuple(a.shape)}; expected {tuple(shape)}")
    if not (np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.integer)):
        raise ValueError(f"array of dtype {a.dtype}; expected numbers")
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))
