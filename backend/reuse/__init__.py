"""Cross-prefix reuse: K/V computed behind one prefix, used behind another.

The span index (what live states hold, found by content: ``spans``), placement — the step of automatic
reuse and of explicit composition: exact copy, RoPE re-alignment (``rotary``), selective recomputation,
the anchor-pool correction of the source papers (``correction``) and the confidence gate (``place``) —,
explicit composition (the compose, merge and fidelity operators: ``compose``) and the sampled online
audit of approximate answers (``audit``).

Below the request runtime: the lifecycle runs the placement step and hands it the forwards it needs
(``place.Forward``); nothing here imports the runtime or the engine (``tests/test_import_layers.py``).
"""
