"""Where SortedRL's rollout time goes, per part of the slot engine (the profile itself:
experiments/lib/sorted_profile.py, shared with bench/bench_sorted.py).

  python experiments/bench/profile_sorted.py --help
"""

from experiments.lib.sorted_profile import main

if __name__ == "__main__":
    main()
