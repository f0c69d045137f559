"""The real-model studies on SmolLM2-135M-Instruct: the scripts (mismatch.py: what each behaviour
policy costs; calibrate.py: a setting against targets on the untrained model; collapse.py:
Sparse-RL's collapse claim; rl.py: short RL runs; tail_study.py: Sparrow's tail) and the modules
they share (measure, lengths, tail, schedule, update_mask, report, refs, prompts, smoke and the
collapse study's plan, collapse_plan)."""
