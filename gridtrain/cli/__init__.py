"""The ``gridtrain`` command line: ``run`` a training script on many processes, print a
``topo``, ``estimate`` a layout.

- ``main``: the parser and the entry point (``gridtrain = gridtrain.cli.main:main``);
- ``run``, ``topo``: one sub-command each, its arguments and its handler (``estimate``'s are
  in ``gridtrain.estimate.cli``);
- ``hosts``: the host lists and the exact command each node runs, as plain data;
- ``procs``: the processes ``gridtrain run`` starts, supervised so none is left over;
- ``prefork``, ``rank``: the agent's workers forked from a copy of it that imported torch once;
- ``agent``: torch's elastic launcher as each node runs it (``python -m gridtrain.cli.agent``);
- ``failures``: the agent's report of a failed job;
- ``usage``: the errors of a command line that cannot run, and loading its config.
"""
