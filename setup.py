from setuptools import find_packages, setup

setup(
    name="gridtrain",
    version="0.1.0",
    description="Config-driven engine for data, tensor, pipeline, sequence and expert parallel training",
    packages=find_packages(include=["gridtrain", "gridtrain.*"]),
    python_requires=">=3.10",
    install_requires=["torch", "pydantic>=2.5,<3", "PyYAML>=6", "tqdm>=4.60"],
    extras_require={"fp8": ["torchao>=0.15"]},  # the fp8 config key (torchao float8 training)
    entry_points={"console_scripts": ["gridtrain = gridtrain.cli.main:main"]},
)
