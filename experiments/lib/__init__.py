"""The experiments' shared library: the figure scaffold (figlib, figplot, figruns, figstats), provenance
(figprov), single-core worker processes (workers), run records and replays, and the studies two
scripts share (figure a's curves, the default experiment, the decode benchmark, the SortedRL
profile, kernel timing). No module here is a script; scripts in figures/, bench/, device/ and
real/ import from here, never from each other. Importing a module here starts no JAX."""
