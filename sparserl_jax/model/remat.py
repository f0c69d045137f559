"""Rematerialisation of the transformer's blocks in the update (`rl.update.remat`): what each
block keeps for the backward pass and what it computes again.

  none       every intermediate the backward pass reads is kept (the MLP's [b, T, F] gate, up and
             activation, the norms, the attention's inputs and output): least compute, most memory.
  full       only the block's input is kept; the whole block (projections, attention, MLP) runs
             again in the backward pass (jax.checkpoint saving nothing): one more forward of every
             block, least memory.
  selective  the block's input and the outputs named SELECTIVE_NAMES are kept: the post-RoPE
             queries, keys and values and the attention's output, each at most [b, T, D]; the
             backward pass recomputes the norms and the MLP (and the attention's softmax where its
             VJP needs it). Between the two in memory (about (2 D + 2 K H) / D times full's saving)
             and in recompute (the q/k/v and output projections are not run again).

`true` / `false` (the setting's original values) read as full / none. The named values are tagged
in model/transformer.py's block (`checkpoint_name`); a policy is jax.checkpoint's `policy`.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.ad_checkpoint import checkpoint_name

SETTING = "rl.update.remat"
POLICIES = ("none", "full", "selective")
SELECTIVE_NAMES = ("qkv", "attn_out")  # model/transformer.py tags these in every block


def policy_name(value: bool | str) -> str:
    """The policy rl.update.remat=`value` names (true: full, false: none); a clear error otherwise."""
    if value is True:
        return "full"
    if value is False:
        return "none"
    if isinstance(value, str) and value in POLICIES:
        return value
    raise ValueError(f"{SETTING}={value!r}: expected one of {', '.join(POLICIES)} (or true = full, false = none)")


def tag(name: str, x):
    """Name a block's intermediate for the selective policy (an identity otherwise)."""
    return checkpoint_name(x, name)


def checkpointed(block: Callable, value: bool | str, *, prevent_cse: bool = True) -> Callable:
    """`block` under the policy rl.update.remat=`value` (unchanged for none). `prevent_cse=False`
    where the block runs as a lax.scan body (scan already keeps XLA from merging the recompute into
    the forward pass)."""
    name = policy_name(value)
    if name == "none":
        return block
    if name == "full":
        return jax.checkpoint(block, prevent_cse=prevent_cse)
    saveable = jax.checkpoint_policies.save_only_these_names(*SELECTIVE_NAMES)
    return jax.checkpoint(block, policy=saveable, prevent_cse=prevent_cse)
