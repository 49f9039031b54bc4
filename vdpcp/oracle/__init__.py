"""The oracle: on one rank, the implementation's sharded encoder against its own unsharded encoder.

Each CP rank r merges the gathered features into a text stream, as a VLM's embedding merge does, and weights the
merged stream with its own deterministic random tensor W_r: L_r = sum(W_r * merged) (vdpcp.feature.loss), as each CP rank's
language model consumes its own tokens; the unsharded reference, computed on the same rank with the same model,
takes L = sum over r of L_r. With sharding on, it then checks:

1. outputs: the gathered features on this rank equal the unsharded features, row for row;
2. input grads, where the implementation declares its path differentiable in its pixels (``pixel_grads``; else
   pixels are data, handed over needing no gradient) and its sharded path carries them: summed over the CP ranks
   they equal the unsharded ones; every image row has a non-zero gradient on exactly one rank (its owner: the
   implementation's plan says which, or it is inferred), and the owner's gradient for it equals the unsharded one;
3. parameter grads: summed over the CP ranks (below float64, a tower over vdpcp.oracle.compare.sketch.WIDTH parameters sums
   count sketches of them) they equal the unsharded gradients; where the implementation
   states a plan, this rank's own equal the unsharded gradients of its own images' rows under the summed
   weights (so the projector stays sharded: gathering before the projector passes the sum but fails this);
4. execution, not the plan: the tower ran on this rank on at least one row (an image or a placeholder; from the
   forward pre-hooks, so outputs-only cases too) through every layer that ran on every CP rank holding real rows
   (a branch only some rows take, a separate video embedder, is not required elsewhere; required_layers), and
   where gradients run every parameter of those layers the unsharded run gives a gradient has one here, so a rank
   holding only placeholders that skips its tower (and would hang a tensor-parallel or FSDP peer) fails, unless
   the implementation says an empty rank may skip it;
   with sharding off, no collective is issued on the CP group;
5. the text stream's gradient, a second consumer of the merged stream's gradient, bit for bit: on this rank its own
   loss's, summed over the CP ranks the unsharded one; and the gradient vdpcp hands each output's backward, kept with
   a copy (handed.py): a backward that writes into it is grad-written (a note where the implementation declares
   ``merges_copy``), and a text-stream difference that is exactly what the write added is not said again;
6. did it shard: which rows reached each rank's tower, seen at the tower's inputs whatever the grad mode
   (vdpcp.oracle.observe.reads): a tower that also runs rows of other ranks, under no_grad too, read them, which is not-sharded;
   and where the implementation declares the objective its partition balances, each rank's load from what it read
   against the best partition under it (vdpcp.oracle.observe.declared_balance: unbalanced).

With sharding off (CP=1, opt-out) every rank encodes everything: outputs, and input and parameter grads
summed over ranks. ``grads=False`` checks outputs only; so does a forward-only implementation, its gradients
"not checked" (RankResult.unchecked_grads). Tolerances: float64 element by element with
assert_close's; below it, vdpcp.oracle.compare.precision (each quantity within the dtype's rtol plus twice this case's own
unsharded run's measured distance from a higher-precision run).

On a gloo CP group the sharded arm runs with the collectives NCCL takes with uneven sizes made right for gloo (any
subgroup: vdpcp.oracle.observe.gloo_collectives), and each rank's result names those that ran (RankResult.collectives).

The model is borrowed from the rank's cache (vdpcp.oracle.model_cache): the unsharded arm runs on it, its gradients are
set aside, and the sharded arm runs on the same weights (or on ``subject_model``'s split of them). Ranks sharing
one GPU take turns for the unsharded arm and its exact run where the case would not fit otherwise (vdpcp.matrix.budget).

The package, one module per job (docs/architecture.md): arms.py ``check`` and the sharded arm, each check in its
order; unsharded.py the unsharded arm, what the sharded one is held to; weights.py whose loss weights and rows are
this rank's own; execution.py what really ran (forward pre-hooks) and the execution checks; split.py whether the
work was split as the case expects; gradients.py the input, parameter and text-stream gradient checks; handed.py
the gradient handed each output's backward, and what the backward wrote into it; telemetry.py time and memory
figures; determinism.py deterministic algorithms, process-wide; context.py the arm and the sharded encode every
check reads (each check returns its findings); failures.py a check's lines as findings.

Internal: vdpcp's own, free to change; what a user imports comes from ``vdpcp`` itself.
"""

from vdpcp.oracle.arms import TURNS_ABOVE, check
from vdpcp.oracle.compare.weights import own_media, own_token_mask
from vdpcp.oracle.observe.execution import Execution, input_rows, ran_by_rank, required_layers
from vdpcp.oracle.observe.telemetry import Clock, Memory
from vdpcp.oracle.unsharded import (
    DP_SEED_STRIDE,
    TORCH_DTYPES,
    Unsharded,
    gradients_checked,
    pixel_grads,
    replica_spec,
)

__all__ = ["DP_SEED_STRIDE", "TORCH_DTYPES", "TURNS_ABOVE", "Clock", "Execution", "Memory", "Unsharded", "check",
           "gradients_checked", "input_rows", "own_media", "own_token_mask", "pixel_grads", "ran_by_rank",
           "replica_spec", "required_layers"]
