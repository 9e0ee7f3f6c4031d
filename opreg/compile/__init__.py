"""opreg's torch.compile machinery, one job per module (imports run down this list):

* :mod:`~opreg.compile.backend`: the ``"opreg"`` Dynamo backend (options, inner compilers,
  the Inductor cache-key pass);
* :mod:`~opreg.compile.pass_manager`: which patterns run, in what order, their cache key;
* :mod:`~opreg.compile.pattern`: the pattern framework (match -> check -> emit loop,
  findings, the graph editor);
* :mod:`~opreg.compile.mutation`: what a node may write, and the mutation-safety rule;
* :mod:`~opreg.compile.fx_utils`: reading nodes, guard-free size comparisons, spelling tables;
* :mod:`~opreg.compile.testing`: ``RecordingBackend`` for tests and pattern authors.

The built-in patterns live in ``opreg/patterns/`` (one file per op). The public entry
points are re-exported by :mod:`opreg.backend`.
"""
