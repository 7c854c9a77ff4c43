"""What every source reader returns: the splits in their natural dtypes."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...utils import FedForgetError


@dataclass(frozen=True)
class SourceArrays:
    """A dataset read from its native files, in natural dtypes (no scaling, no float).

    - images: ``x`` uint8 ``[N, C, H, W]`` (C = 1 or 3); image-folder datasets return
      read-only memory maps of ``.npy`` files, so data larger than RAM never sit in memory;
    - text: ``x`` int64 token ids ``[N, L]``, the attention masks (int64 ``[N, L]``) in
      ``extra["attention_mask_train"]`` / ``extra["attention_mask_test"]``. ``x`` stays one
      array for every modality, so the prepared format writes it the same way;
    - ``y`` int64 ``[N]`` class indices into ``class_names``.

    ``extra`` holds anything else a source has, keyed ``<what>_<split>`` for per-row arrays
    (a validation split as ``x_val``/``y_val``, CIFAR-100's ``coarse_train``, DomainNet's
    ``domain_train``) and plain names for the rest (``coarse_names``, ``domain_names``).
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    class_names: tuple[str, ...]
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for split in ("train", "test"):
            x, y = getattr(self, f"x_{split}"), getattr(self, f"y_{split}")
            if y.dtype != np.int64 or y.ndim != 1:
                raise FedForgetError(f"y_{split}: int64 [N] expected, got {y.dtype} {y.shape}")
            if len(x) != len(y):
                raise FedForgetError(f"{split}: {len(x)} inputs but {len(y)} labels")
            if len(y) and (y.min() < 0 or y.max() >= len(self.class_names)):
                raise FedForgetError(
                    f"y_{split}: labels in [{y.min()}, {y.max()}], allowed 0..{len(self.class_names) - 1}"
                )

    @property
    def num_classes(self) -> int:
        return len(self.class_names)
