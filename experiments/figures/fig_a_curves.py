"""Figure a: training curves of dense, naive sparse and Sparse-RL rollouts (the study and its
render: experiments/lib/curves.py, shared with the default experiment).

  python experiments/figures/fig_a_curves.py --smoke
  python experiments/figures/fig_a_curves.py --seeds 0 1 2 3 4
"""

from experiments.lib.curves import main

if __name__ == "__main__":
    main()
