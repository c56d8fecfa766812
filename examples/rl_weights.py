"""Reinforcement learning, IMPALA-style: a learner's policy to every actor, their
trajectories back to the learner, every iteration.

The learner holds a softmax policy, a small MLP whose model is a dict of layer
arrays (``{"hidden": {"weight", "bias"}, "out": {"weight", "bias"}}``, float32,
68 MiB by default). Each iteration:

1. every rollout worker runs the current policy in its own environment (the
   rollout tasks depend on the policy: Dask moves it to every worker; with
   dask-hoplite, as one pipelined broadcast) and returns a trajectory of
   observations, actions and rewards (4 MiB by default);
2. the learner gathers the trajectories and takes a policy-gradient step
   (REINFORCE with a baseline, back-propagated through both layers).

The environment is a contextual bandit with a hidden linear rule: the reward is
1 when the action is the one the hidden rule picks for the observation, so the
mean reward rises as the policy learns. Reports iterations per second after
the first iteration, and the first iteration's seconds on their own, with Dask
alone and with dask-hoplite, and whether the learned policies agree. (The
Hoplite paper reports IMPALA and A3C up to 3.9x faster than on Ray.)

    python examples/rl_weights.py [--emulated] [--obs 16384] [--actions 1024] [--steps 64]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
from distributed import Client, wait  # noqa: E402
from harness import Outcome, add_cluster_arguments, loop_metrics, run_both  # noqa: E402

#: A policy: ``{"hidden": {"weight": (obs, HIDDEN), "bias": (HIDDEN,)},
#: "out": {"weight": (HIDDEN, actions), "bias": (actions,)}}``, float32.
Policy = dict[str, dict[str, np.ndarray]]

#: Units of the policy's hidden layer.
HIDDEN = 1024


def init_policy(obs: int, actions: int, hidden: int = HIDDEN) -> Policy:
    """Small random hidden weights (seeded: every run starts alike), zero
    output weights and biases."""
    rng = np.random.default_rng(7)
    w1 = rng.standard_normal((obs, hidden), dtype=np.float32) / np.float32(np.sqrt(obs))
    return {
        "hidden": {"weight": w1, "bias": np.zeros(hidden, dtype=np.float32)},
        "out": {
            "weight": np.zeros((hidden, actions), dtype=np.float32),
            "bias": np.zeros(actions, dtype=np.float32),
        },
    }


def forward(policy: Policy, obs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The hidden activations and the action probabilities for ``obs``."""
    h = np.maximum(obs @ policy["hidden"]["weight"] + policy["hidden"]["bias"], 0)
    return h, softmax(h @ policy["out"]["weight"] + policy["out"]["bias"])


#: The hidden rule looks at this many leading features of an observation.
RULE_FEATURES = 64


def hidden_rule(obs: int, actions: int) -> np.ndarray:
    """The environment's rule: the best action for an observation ``o`` is
    ``argmax(o[:RULE_FEATURES] @ rule)``."""
    k = min(RULE_FEATURES, obs)
    return np.random.default_rng(0).standard_normal((k, actions), dtype=np.float32)


def softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(z)
    return p / p.sum(axis=1, keepdims=True)


def dims(policy: Policy) -> tuple[int, int]:
    """The observation size and the number of actions of ``policy``."""
    return policy["hidden"]["weight"].shape[0], policy["out"]["weight"].shape[1]


def rollout(policy: Policy, actor: int, iteration: int, steps: int) -> dict[str, np.ndarray]:
    """``steps`` interactions of actor ``actor`` with its environment."""
    obs_dim, n_actions = dims(policy)
    rng = np.random.default_rng((actor, iteration))
    observations = rng.standard_normal((steps, obs_dim), dtype=np.float32)
    _, probs = forward(policy, observations)
    cumulative = probs.cumsum(axis=1)
    actions = (cumulative < rng.random((steps, 1), dtype=np.float32)).sum(axis=1)
    actions = np.minimum(actions, n_actions - 1)
    rule = hidden_rule(obs_dim, n_actions)
    best = (observations[:, : len(rule)] @ rule).argmax(axis=1)
    rewards = (actions == best).astype(np.float32)
    return {"observations": observations, "actions": actions, "rewards": rewards}


def rollout_stand_in(
    seconds: float, policy: Policy, actor: int, iteration: int, steps: int
) -> dict[str, np.ndarray]:
    """For the benchmark on a machine whose cores the emulated hosts share: a
    trajectory of :func:`rollout`'s shapes and types after ``seconds`` (the
    rollout's single-core time) of sleep instead of the interactions. The
    examples never use it."""
    t0 = time.perf_counter()
    obs_dim, _ = dims(policy)
    out = {
        "observations": np.ones((steps, obs_dim), dtype=np.float32),
        "actions": np.zeros(steps, dtype=np.int64),
        "rewards": np.zeros(steps, dtype=np.float32),
    }
    time.sleep(max(0.0, seconds - (time.perf_counter() - t0)))
    return out


def learn(policy: Policy, rate: float, *trajectories: dict[str, np.ndarray]) -> Policy:
    """One REINFORCE step on all trajectories (the mean reward as baseline),
    back-propagated through the output and the hidden layer."""
    obs = np.concatenate([t["observations"] for t in trajectories])
    actions = np.concatenate([t["actions"] for t in trajectories])
    rewards = np.concatenate([t["rewards"] for t in trajectories])
    advantage = rewards - rewards.mean()
    h, probs = forward(policy, obs)
    grad_logits = -probs
    grad_logits[np.arange(len(actions)), actions] += 1.0
    grad_logits *= advantage[:, None]
    grad_h = (grad_logits @ policy["out"]["weight"].T) * (h > 0)
    grads = {
        "hidden": {"weight": obs.T @ grad_h, "bias": grad_h.sum(axis=0)},
        "out": {"weight": h.T @ grad_logits, "bias": grad_logits.sum(axis=0)},
    }
    step = np.float32(rate / len(actions))
    return {
        layer: {name: policy[layer][name] + step * grads[layer][name] for name in policy[layer]}
        for layer in policy
    }


def mean_reward(*trajectories: dict[str, np.ndarray]) -> float:
    return float(np.mean([t["rewards"].mean() for t in trajectories]))


def workload(
    client: Client,
    workers: list[str],
    obs: int,
    actions: int,
    steps: int,
    iterations: int,
    stand_in: float | None = None,
) -> Outcome:
    """Train; the result is the policy and the mean reward of each iteration,
    the metrics the iterations' rate (:func:`harness.loop_metrics`).
    ``stand_in``: seconds of sleep that replace each rollout's interactions
    (:func:`rollout_stand_in`)."""
    act = rollout if stand_in is None else functools.partial(rollout_stand_in, stand_in)
    learner = workers[0]
    policy = client.submit(init_policy, obs, actions, workers=[learner])
    wait(policy)
    rewards, seconds = [], []
    for it in range(iterations):
        t0 = time.perf_counter()
        trajectories = [
            client.submit(act, policy, i, it, steps, workers=[w], pure=False)
            for i, w in enumerate(workers)
        ]
        policy = client.submit(learn, policy, 1.0, *trajectories, workers=[learner], pure=False)
        wait(policy)
        seconds.append(time.perf_counter() - t0)
        rewards.append(client.submit(mean_reward, *trajectories, workers=[learner]).result())
    return Outcome(
        {"policy": policy.result(), "rewards": rewards},
        loop_metrics(f"iterations/s ({len(workers)} actors)", "first iteration, s", seconds),
        seconds,
    )


def reference(n: int, obs: int, actions: int, steps: int, iterations: int) -> Policy:
    """The same training in this process with numpy alone."""
    policy = init_policy(obs, actions)
    for it in range(iterations):
        policy = learn(policy, 1.0, *(rollout(policy, i, it, steps) for i in range(n)))
    return policy


def close(a: Policy, b: Policy, rtol: float = 1e-3, atol: float = 1e-5) -> bool:
    """Two policies agree, layer by layer."""
    return all(
        np.allclose(a[layer][name], b[layer][name], rtol=rtol, atol=atol)
        for layer in b
        for name in b[layer]
    )


def agree(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return close(a["policy"], b["policy"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_cluster_arguments(p)
    p.add_argument("--obs", type=int, default=16384, help="observation size (float32)")
    p.add_argument("--actions", type=int, default=1024)
    p.add_argument("--steps", type=int, default=64, help="steps per trajectory")
    p.add_argument("--iterations", type=int, default=8)
    args = p.parse_args(argv)
    policy_mib = (args.obs * HIDDEN + HIDDEN + HIDDEN * args.actions + args.actions) * 4 / 2**20
    traj_mib = args.steps * args.obs * 4 / 2**20
    title = (
        f"RL weight sync: a {policy_mib:.0f} MiB MLP policy to {args.workers} actors, "
        f"{traj_mib:.0f} MiB trajectories back"
    )
    return run_both(
        args,
        title,
        lambda c, w: workload(c, w, args.obs, args.actions, args.steps, args.iterations),
        agree,
    )


if __name__ == "__main__":
    sys.exit(main())
