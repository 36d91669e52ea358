"""ADM's five numbers: FID, sFID, Inception Score, precision, recall (guided-diffusion's evaluations/evaluator.py).

The features come from one Inception pass (`torchtitan/tools/fid.py`: pool_3 and mixed_6/conv[..., :7]); the
metrics follow the evaluator's definitions:

- FID and sFID: the Frechet distance between the (mu, sigma) of the pool_3 and the spatial features, a reference
  batch's stored statistics used as stored.
- Inception Score: softmax(pool_3 @ W), W the graph's `softmax/logits/MatMul` weight (no bias: the evaluator takes
  the MatMul's input, not the logits node), then exp(E_x KL(p(y|x) || p(y))) over consecutive splits of 5000 samples,
  averaged over the splits (50,000 samples: 10 splits), after improved-gan's inception_score.
- Precision and recall: Kynkaanniemi et al. 2019's k-NN manifolds (k = 3) on pool_3 features, as the evaluator's
  ManifoldEstimator computes them: a point's radius is its squared distance to its k-th nearest neighbour in its own
  set (the point itself counts as the 0th); precision is the share of samples inside some reference ball, recall the
  share of the reference inside some sample ball. The evaluator computes every squared distance as
  max(|u|^2 - 2 u.v + |v|^2, 0) in float16 (inputs rounded to float16, each op's result rounded to float16), and a
  10000 x 10000 block in float32 instead when any float16 value of it is not finite; we do the same, accumulating
  the norms' and the matmul's sums in float32 as TensorFlow's GPU kernels do. float16 puts ~0.05% of relative
  round-off on each distance, enough to move a point across a radius: `precision="float64"` gives the rounding-free
  numbers of the same definition.

Differences that remain: statistics and softmax are float64 here where the evaluator keeps float32 features (its
np.cov is float64 too), and sums are accumulated in another order; both move the numbers in their last digits.
"""

import numpy as np
import torch
from scipy.special import logsumexp

from torchtitan.tools.fid import EvalBatch, exact_fp32, frechet_distance

IS_SPLIT_SIZE = 5000  # compute_inception_score(split_size=5000)
NEIGHBOURHOOD = 3  # ManifoldEstimator(nhood_sizes=(3,))
DISTANCE_BATCH = 10000  # ManifoldEstimator(row_batch_size=10000, col_batch_size=10000)
METRICS = ("inception_score", "fid", "sfid", "precision", "recall")  # the evaluator's print order


def class_probabilities(pool: np.ndarray, logits_weight: np.ndarray | torch.Tensor) -> np.ndarray:
    """(N, 2048) pool_3 features, (classes, 2048) softmax weight -> (N, classes) float64 softmax(pool @ W^T)."""
    logits = np.asarray(pool, dtype=np.float64) @ np.asarray(logits_weight, dtype=np.float64).T
    shifted = np.exp(logits - logits.max(1, keepdims=True))
    return shifted / shifted.sum(1, keepdims=True)


def inception_score(probabilities: np.ndarray, split_size: int = IS_SPLIT_SIZE) -> float:
    """exp(mean_x KL(p(y|x) || p(y))) on each split of `split_size` consecutive rows, averaged over the splits.

    p(y) is the split's mean prediction, taken in log space: a saturated float64 softmax holds denormal
    probabilities whose mean would round to 0 under the row's own (log p(y|x) - log p(y)). 0 log 0 = 0.
    """
    scores = []
    for start in range(0, len(probabilities), split_size):
        part = probabilities[start : start + split_size]
        with np.errstate(divide="ignore"):
            log_part = np.log(part)
        log_marginal = logsumexp(log_part, axis=0) - np.log(len(part))  # (classes,)
        with np.errstate(invalid="ignore"):  # 0 * (-inf - -inf) where a class is never predicted: 0 by np.where
            kl = np.where(part > 0, part * (log_part - log_marginal), 0.0)
        scores.append(np.exp(kl.sum(1).mean()))
    return float(np.mean(scores))


def _pairwise(u: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The evaluator's max(|u|^2 - 2 u v^T + |v|^2, 0) with its inputs and every op's result in `dtype`."""
    u, v = u.to(dtype), v.to(dtype)
    accumulate = torch.float32 if dtype == torch.float16 else dtype  # fp16 sums and GEMMs accumulate in fp32
    norm_u = (u * u).to(accumulate).sum(1).to(dtype)  # tf.square rounds each square, reduce_sum accumulates
    norm_v = (v * v).to(accumulate).sum(1).to(dtype)
    dot = (u.to(accumulate) @ v.to(accumulate).T).to(dtype)  # (rows, cols)
    return (norm_u[:, None] - 2 * dot + norm_v[None, :]).clamp_min(0)


def pairwise_distances(u: torch.Tensor, v: torch.Tensor, precision: str = "adm") -> torch.Tensor:
    """Squared distances of one block as the evaluator's DistanceBlock gives them (`adm`: float16, this block in
    float32 if any float16 value is not finite; returned as float32), or exactly (`float64`)."""
    if precision == "float64":
        return _pairwise(u, v, torch.float64)
    if precision != "adm":
        raise ValueError(f"precision {precision!r}: 'adm' or 'float64'")
    half = _pairwise(u, v, torch.float16)
    return half.float() if torch.isfinite(half).all() else _pairwise(u, v, torch.float32)


def manifold_radii(features: torch.Tensor, k: int = NEIGHBOURHOOD, batch_size: int = DISTANCE_BATCH,
                   precision: str = "adm") -> torch.Tensor:  # fmt: skip
    """(N,) squared distance from each point to its k-th nearest neighbour in the set, itself being the 0th."""
    radii = []
    for r0 in range(0, len(features), batch_size):
        rows = features[r0 : r0 + batch_size]
        blocks = [pairwise_distances(rows, features[c0 : c0 + batch_size], precision)
                  for c0 in range(0, len(features), batch_size)]  # fmt: skip
        radii.append(torch.cat(blocks, 1).topk(k + 1, dim=1, largest=False).values[:, k])  # (rows,)
    return torch.cat(radii)


def precision_recall(reference: np.ndarray, samples: np.ndarray, k: int = NEIGHBOURHOOD,
                     batch_size: int = DISTANCE_BATCH, precision: str = "adm",
                     device: torch.device | str = "cpu") -> tuple[float, float]:  # fmt: skip
    """Improved precision and recall (Kynkaanniemi et al. 2019) of samples against a reference, by the evaluator.

    Args:
        reference: (N1, D) reference features (ADM: pool_3 of the reference batch's images).
        samples: (N2, D) sample features.
        k: the neighbour whose distance is a point's radius.
        batch_size: rows and columns of one distance block (the float16 fallback is decided per block).
        precision: "adm" (float16 distances, as the evaluator) or "float64".
        device: where the distances are computed.

    Returns:
        (precision, recall): the share of samples inside the reference manifold, and of the reference inside the
        samples' manifold.
    """
    for name, features in (("reference", reference), ("samples", samples)):
        if len(features) <= k:
            raise ValueError(f"precision and recall need more than k = {k} {name} images, got {len(features)}")
    ref, gen = (torch.as_tensor(np.asarray(x, dtype=np.float64), device=device) for x in (reference, samples))
    with exact_fp32():
        ref_radii, gen_radii = (manifold_radii(x, k, batch_size, precision) for x in (ref, gen))
        ref_in = torch.zeros(len(ref), dtype=torch.bool, device=ref.device)
        gen_in = torch.zeros(len(gen), dtype=torch.bool, device=ref.device)
        for r0 in range(0, len(ref), batch_size):
            r1 = r0 + batch_size
            for c0 in range(0, len(gen), batch_size):
                c1 = c0 + batch_size
                distances = pairwise_distances(ref[r0:r1], gen[c0:c1], precision)  # (ref rows, sample cols)
                ref_in[r0:r1] |= (distances <= gen_radii[None, c0:c1]).any(1)
                gen_in[c0:c1] |= (distances <= ref_radii[r0:r1, None]).any(0)
    return gen_in.double().mean().item(), ref_in.double().mean().item()


def evaluate(samples: EvalBatch, reference: EvalBatch, logits_weight: np.ndarray | torch.Tensor | None,
             device: torch.device | str = "cpu") -> tuple[dict[str, float | None], dict[str, str]]:  # fmt: skip
    """ADM's five numbers of a sample batch against a reference batch, each where its inputs are there.

    Returns:
        ({metric: value or None}, {metric: why it is None}) over `METRICS`.
    """
    values: dict[str, float | None] = dict.fromkeys(METRICS)
    reasons: dict[str, str] = {}
    values["fid"] = frechet_distance(*samples.statistics, *reference.statistics)
    lacking = [str(b.path) for b in (samples, reference) if b.spatial_statistics is None]
    if lacking:
        reasons["sfid"] = f"needs mu_s/sigma_s, or arr_0 images through the pool_3 network, in {' and '.join(lacking)}"
    else:
        values["sfid"] = frechet_distance(*samples.spatial_statistics, *reference.spatial_statistics)
    if samples.pool is None or samples.spatial is None:
        why = f"needs {samples.path}'s arr_0 images through the pool_3 network (--dims 2048)"
        reasons.update(inception_score=why, precision=why, recall=why)
        return values, reasons
    if logits_weight is None:
        reasons["inception_score"] = "needs the weights' fc.weight"
    else:
        values["inception_score"] = inception_score(class_probabilities(samples.pool, logits_weight))
    if reference.pool is None:
        reasons["precision"] = reasons["recall"] = f"needs {reference.path}'s arr_0 images (it holds statistics only)"
    else:
        values["precision"], values["recall"] = precision_recall(reference.pool, samples.pool, device=device)
    return values, reasons
