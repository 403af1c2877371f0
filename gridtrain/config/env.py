"""The environment variable through which `gridtrain run --config FILE` hands every rank its
config file (read by ``gt.launch_from_torch`` and the other launchers)."""

CONFIG_ENV = "GRIDTRAIN_CONFIG"
