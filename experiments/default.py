"""The landing command: the default experiment, dense vs naive sparse vs Sparse-RL rollouts over
warm starts and RL seeds (what it runs and writes: experiments/lib/default_experiment.py).

  python experiments/default.py            # 3 warm starts x 2 RL seeds, 40 iterations
  python experiments/default.py --smoke    # seconds, for tests
  python experiments/default.py --replot experiments/results/default   # re-render, no training
"""

from experiments.lib.default_experiment import main

if __name__ == "__main__":
    main()
