"""The sampler's decode throughput, dense vs sparse KV (the benchmark itself:
experiments/lib/decode_bench.py, shared with figure f and the device check).

  python experiments/bench/bench_decode.py --help
"""

from experiments.lib.decode_bench import main

if __name__ == "__main__":
    main()
