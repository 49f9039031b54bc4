"""A small RADIO-like vision tower and its projector. It knows nothing about parallelism.

    packed patches [1, N, 3*P*P]
      -> tubelets: T consecutive frames of a video stacked channel-wise (the last one repeats its final frame)
      -> patch embedding + a learned position per grid cell
      -> transformer blocks, attention only within each image / tubelet (its cu_seqlens segment)
      -> even-grid padding (zero rows/cols; only 1x1 placeholders are odd) -> factor-2 pixel shuffle
      -> projector (MLP) into the language model's hidden size

Every image is encoded independently of every other, which is what makes vision DP over CP exact.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vdpcp.feature.spec import DEFAULT_PATCH_DIM


@dataclass(frozen=True)
class TowerConfig:
    patch_dim: int = DEFAULT_PATCH_DIM
    temporal_patch_size: int = 1
    hidden: int = 32
    heads: int = 2
    layers: int = 2
    max_grid: int = 64  # positions per grid axis
    # Positions kept per axis (None: max_grid). The whole max_grid table is drawn either way, so every weight is
    # the same whatever is kept; a case keeps what its microbatch needs (Implementation.build_model), since the rest
    # would be most of the toy tower's parameters, copied, all-reduced and compared for nothing.
    positions: int | None = None
    lm_hidden: int = 48  # the projector's output: the language model's hidden size
    pad_odd_grids: bool = True  # False reproduces the pixel-shuffle crash on placeholder microbatches
    seed: int = 0


# Tower sizes a case can ask for (Case.tower): the toy tower above (CPU CI), and the size this tower stands for,
# ViT-L/16 as RADIO's (hidden 1024, 24 layers, 16 heads) into an LM of Nemotron Omni's width (2688), with
# positions for grids up to 128 patches (2048 px), for GPU runs at the size people train.
TOWERS = {
    "toy": {},
    "real": dict(hidden=1024, heads=16, layers=24, lm_hidden=2688, max_grid=128),
}
REAL_PATCH = 16  # the real size's patch side (ViT-L/16)


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x: torch.Tensor, seqlens: list[int]) -> torch.Tensor:
        attended = [self._attend(seg) for seg in self.norm1(x).split(seqlens)]
        x = x + self.out(torch.cat(attended) if attended else x[:0])  # an empty microbatch has no segment
        return x + self.mlp(self.norm2(x))

    def _attend(self, seg: torch.Tensor) -> torch.Tensor:
        n, d = seg.shape
        # [1, heads, n, head_dim]: SDPA's fused kernels (flash, memory-efficient) take 4-D inputs only; 3-D
        # falls back to the math kernel, whose n x n scores make memory quadratic in an image's patches.
        q, k, v = self.qkv(seg).view(1, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v)[0].transpose(0, 1).reshape(n, d)


class VisionModel(nn.Module):
    """Tower + projector. ``encode`` stops before the projector so the sharded path can project, then gather."""

    def __init__(self, config: TowerConfig = TowerConfig(), device=None):
        super().__init__()
        c = self.config = config
        with seeded(c.seed, device):  # deterministic init: every rank the same weights
            self._build(c)

    def _build(self, c: TowerConfig) -> None:
        self.embed = nn.Linear(c.temporal_patch_size * 3 * c.patch_dim**2, c.hidden)
        kept = c.max_grid if c.positions is None else min(c.positions, c.max_grid)
        if kept < 1:
            raise ValueError(f"TowerConfig.positions is {c.positions}; expected at least 1")
        self.pos = nn.Parameter((0.02 * torch.randn(c.max_grid, c.max_grid, c.hidden))[:kept, :kept].clone())
        self.blocks = nn.ModuleList(Block(c.hidden, c.heads) for _ in range(c.layers))
        self.norm = nn.LayerNorm(c.hidden)
        self.projector = nn.Sequential(
            nn.LayerNorm(4 * c.hidden), nn.Linear(4 * c.hidden, c.lm_hidden), nn.GELU(), nn.Linear(c.lm_hidden, c.lm_hidden)
        )

    def forward(self, patches, imgs_sizes, num_frames=None) -> torch.Tensor:
        return self.project(self.encode(patches, imgs_sizes, num_frames))

    def encode(self, patches: torch.Tensor, imgs_sizes, num_frames=None) -> torch.Tensor:
        """Packed patches [1, N, 3*P*P] -> pixel-shuffled features [tokens, 4*hidden], images in order."""
        grids = [(int(h) // self.config.patch_dim, int(w) // self.config.patch_dim) for h, w in _pairs(imgs_sizes)]
        units, unit_grids = self._tubelets(patches[0], grids, num_frames)
        kept = self.pos.shape[0]
        too_large = [grid for grid in unit_grids if max(grid) > kept]
        if too_large:
            raise ValueError(f"a {too_large[0][0]}x{too_large[0][1]} patch grid is larger than the tower's position "
                             f"table ({kept}x{kept} patches: TowerConfig.positions / max_grid)")
        # The patch embedding takes pixels in its own dtype, as a published tower's does: a loader's float32 pixels
        # are cast here (vdpcp.feature.pixels), and what comes out is the tower's, whatever went in.
        embedded = [self.embed(u.to(self.pos.dtype)) + self.pos[:gh, :gw].reshape(gh * gw, -1)
                    for u, (gh, gw) in zip(units, unit_grids)]
        x = torch.cat(embedded) if embedded else self.pos.new_zeros(0, self.config.hidden)
        seqlens = [gh * gw for gh, gw in unit_grids]
        for block in self.blocks:
            x = block(x, seqlens)
        x = self.norm(x)
        shuffled = []
        for feats, (gh, gw) in zip(x.split(seqlens), unit_grids):
            grid = feats.view(gh, gw, -1)
            if self.config.pad_odd_grids:
                grid = pad_patch_grid_to_even(grid)
            shuffled.append(pixel_shuffle(grid))
        return torch.cat(shuffled) if shuffled else x.new_zeros(0, 4 * self.config.hidden)

    def project(self, features: torch.Tensor) -> torch.Tensor:
        return self.projector(features)

    def _tubelets(self, frames: torch.Tensor, grids, num_frames):
        """Group rows into encoder units: each row alone (T=1), or T frames of a video stacked channel-wise."""
        T = self.config.temporal_patch_size
        rows = list(frames.split([gh * gw for gh, gw in grids]))
        if T == 1:
            return rows, grids
        if num_frames is None:
            raise ValueError(f"num_frames is required when temporal_patch_size={T} > 1")
        units, unit_grids, row = [], [], 0
        for n in [int(n) for n in num_frames]:
            for k in range(0, n, T):
                chunk = rows[row + k : row + min(k + T, n)]
                chunk += [chunk[-1]] * (T - len(chunk))  # a short last tubelet repeats its final frame
                units.append(torch.cat(chunk, dim=-1))
                unit_grids.append(grids[row + k])
            row += n
        return units, unit_grids


@contextmanager
def seeded(seed: int, device=None):
    """Tensors made in the block are drawn from ``seed`` on ``device`` (default the CPU), the same on every rank, and
    the generator is left as it was. On the CPU its generator only, as torch.manual_seed would also queue a lazy
    seed for every GPU; on a GPU that GPU's, so a real-size tower is drawn where it runs, not on one CPU thread."""
    device = torch.device(device or "cpu")
    cuda = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda), torch.device(device):
        torch.default_generator.manual_seed(seed)
        for index in cuda:
            with torch.cuda.device(index):
                torch.cuda.manual_seed(seed)
        yield


def positions_needed(grids) -> int:
    """Positions per grid axis a microbatch's (gh, gw) patch grids need (at least 1)."""
    return max((side for grid in grids for side in grid), default=1)


def pad_patch_grid_to_even(grid: torch.Tensor) -> torch.Tensor:
    """Zero-pad a [h, w, C] patch grid to even h and w (the 1x1 placeholder becomes 2x2)."""
    h, w, _ = grid.shape
    return F.pad(grid, (0, 0, 0, w % 2, 0, h % 2))


def pixel_shuffle(grid: torch.Tensor) -> torch.Tensor:
    """Fold each 2x2 block of a [h, w, C] grid into one token: [h/2 * w/2, 4C]. Odd grids are rejected."""
    h, w, c = grid.shape
    if h % 2 or w % 2:
        raise ValueError(f"pixel shuffle needs an even patch grid, got {h}x{w}")
    return grid.view(h // 2, 2, w // 2, 2, c).permute(0, 2, 1, 3, 4).reshape(h * w // 4, 4 * c)


def output_tokens(grid: tuple[int, int]) -> int:
    """Tokens a (gh, gw) grid yields after even padding and the pixel shuffle."""
    gh, gw = grid
    return ((gh + 1) // 2) * ((gw + 1) // 2)


def _pairs(imgs_sizes):
    return imgs_sizes.tolist() if isinstance(imgs_sizes, torch.Tensor) else imgs_sizes
