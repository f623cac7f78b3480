"""FID (Heusel et al. 2017) and KID (Binkowski et al. 2018) of a set of images against a folder
of reference images, with torch-fidelity's own Inception feature extractor and formulas; its
weights come from a local file, never from the network (docs/dependencies.md: why
torch-fidelity).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from maskgrpo_ray.config.metrics import METRICS_DOCS, MetricSpec
from maskgrpo_ray.evaluation.metric_files import check_metric_files, image_files, missing_file
from maskgrpo_ray.extras import require


class FidKid:
    """FID and KID of a set of images against a folder of reference images.

    torch-fidelity's ``calculate_metrics(fid=True, kid=True)`` on two folders, on our images:
    its Inception-v3 (``inception-v3-compat``, 2048-d pool features of uint8 images, resized by
    the extractor to 299 px), its FID (TTUR's formula, statistics in float64) and its KID
    (100 subsets, polynomial kernel, ``rng_seed`` 2020, images in sorted path order). Folder
    features are kept in memory, keyed by the folder and its files' sizes and times, so the
    reference set is read once per instance.

    Args:
        spec: a ``kind="fid"`` metric; ``spec.weights`` is the Inception state dict file.
        device: where Inception runs (default: CPU).
        where: the spec's place in the config for messages (:func:`check_metric_files`).

    Raises:
        MetricWeightsMissingError: the weights file or the reference images are not here.
        ValueError: the weights file is not torch-fidelity's Inception state dict.
    """

    def __init__(
        self, spec: MetricSpec, device: torch.device | None = None, where: str | None = None
    ) -> None:
        if spec.kind != "fid":
            raise ValueError(f"FidKid needs a kind=fid metric, got kind={spec.kind}")
        self.where = where or f"metric {spec.label!r}"
        check_metric_files(spec, self.where)  # torch-fidelity installed, the files here
        fe = require("torch_fidelity.feature_extractor_inceptionv3", self.where)
        self.spec, self.device = spec, device or torch.device("cpu")
        try:
            self.extractor = fe.FeatureExtractorInceptionV3(
                "inception-v3-compat", ["2048"], feature_extractor_weights_path=spec.weights
            ).to(self.device)
        except (RuntimeError, KeyError, TypeError, AttributeError, OSError) as err:
            raise ValueError(
                f"{self.where}.weights: {spec.weights} is not torch-fidelity's Inception state "
                f"dict ({type(err).__name__}: {str(err)[:200]}); use "
                f"weights-inception-2015-12-05-6726825d.pth (see {METRICS_DOCS})"
            ) from err
        self._folders: dict[str, tuple[tuple[tuple[str, int, int], ...], torch.Tensor]] = {}

    @torch.no_grad()
    def features(self, images: torch.Tensor) -> torch.Tensor:
        """Inception pool features float32 ``[N, 2048]`` (CPU) of uint8 ``[N, H, W, 3]``."""
        out = [torch.zeros(0, 2048)]
        for s in range(0, images.shape[0], self.spec.batch_size):
            x = images[s : s + self.spec.batch_size].permute(0, 3, 1, 2).contiguous()  # [n,3,H,W]
            out.append(self.extractor(x.to(self.device))[0].float().cpu())  # [n, 2048]
        return torch.cat(out)

    def folder_features(self, folder: Path) -> torch.Tensor:
        """Features ``[N, 2048]`` of a folder's images in sorted path order (RGB-converted;
        images of different sizes go through the extractor in separate batches)."""
        import numpy as np
        from PIL import Image

        paths = image_files(folder)
        files = tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in paths)
        cached = self._folders.get(str(folder.resolve()))
        if cached is not None and cached[0] == files:
            return cached[1]
        chunks, bs = [torch.zeros(0, 2048)], self.spec.batch_size
        for s in range(0, len(paths), bs):
            arrays = [np.asarray(Image.open(p).convert("RGB")) for p in paths[s : s + bs]]
            for run in same_shape_runs(arrays):
                chunks.append(self.features(torch.from_numpy(np.stack(run))))  # [n, 2048]
        feats = torch.cat(chunks)  # [R, 2048]
        self._folders[str(folder.resolve())] = (files, feats)
        return feats

    def __call__(
        self, images: torch.Tensor | str | Path, reference_dir: str | Path | None = None
    ) -> dict[str, float]:
        """FID and KID of ``images`` (uint8 ``[N, H, W, 3]``, or a folder of images) against
        ``reference_dir`` (default: ``spec.reference_dir``).

        Returns:
            ``fid``; ``kid_mean`` and ``kid_std`` over the KID subsets; ``kid_subset_size``,
            the subset size used: ``spec.kid_subset_size`` capped at the smaller image count.
        """
        from torch_fidelity.metric_fid import (  # installed: __init__ required torch_fidelity
            fid_features_to_statistics,
            fid_statistics_to_metric,
        )
        from torch_fidelity.metric_kid import kid_features_to_metric

        ref_dir = Path(str(reference_dir or self.spec.reference_dir))
        if not image_files(ref_dir):
            missing_file(self.where, "reference_dir", ref_dir, "holds no images", "fill it")
        ref = self.folder_features(ref_dir)  # [R, 2048]
        if isinstance(images, torch.Tensor):
            if images.dtype != torch.uint8 or images.dim() != 4 or images.shape[-1] != 3:
                raise ValueError(
                    f"FID/KID images must be uint8 [N, H, W, 3], got {images.dtype} "
                    f"{tuple(images.shape)}"
                )
            gen = self.features(images)  # [N, 2048]
        else:
            gen = self.folder_features(Path(images))
        if min(len(gen), len(ref)) < 2:
            raise ValueError(
                f"FID/KID need at least 2 images on each side: {len(gen)} images, {len(ref)} "
                f"reference images in {ref_dir}"
            )
        fid = fid_statistics_to_metric(
            fid_features_to_statistics(gen), fid_features_to_statistics(ref), verbose=False
        )["frechet_inception_distance"]
        subset = min(self.spec.kid_subset_size, len(gen), len(ref))
        kid = kid_features_to_metric(gen, ref, kid_subset_size=subset, verbose=False)
        return {
            "fid": float(fid),
            "kid_mean": float(kid["kernel_inception_distance_mean"]),
            "kid_std": float(kid["kernel_inception_distance_std"]),
            "kid_subset_size": float(subset),
        }


def same_shape_runs(arrays: Sequence[Any]) -> list[list[Any]]:
    """Split ``arrays`` into consecutive runs of equal ``.shape`` (order kept)."""
    runs: list[list[Any]] = []
    for a in arrays:
        if runs and runs[-1][0].shape == a.shape:
            runs[-1].append(a)
        else:
            runs.append([a])
    return runs
