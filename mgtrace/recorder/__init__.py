"""Recording from a live vLLM engine, and importing the field probe logs.

The in-engine side (``agent``, ``hooks_*``, ``capture``, ``control``, ``plugin``) imports
neither vLLM nor torch at module load: a process that loads the plugin inert pays nothing
until recording starts. The CLI side (``attach``, ``proctree``, ``inject``, ``cli``) never
runs inside the engine.
"""
