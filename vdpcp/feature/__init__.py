"""The feature as a reference, knowing nothing of the suite: plan -> split -> encode -> project -> gather.

spec.py a microbatch's vision inputs; plan.py which CP rank encodes which images or tubelets; balance.py how even
a split is; sharded.py the reference sharded encoder; comm.py everything that crosses ranks; layout.py and
tensor_parallel.py the parallel layout; model.py the small vision tower and projector; loss.py the media merge
and each CP rank's loss; grads.py a gradient as the checks read it; pixels.py how pixels reach a tower;
datasets.py dataset-shaped microbatches.

Internal: vdpcp's own, free to change; what a user imports comes from ``vdpcp`` itself.
"""
