"""What stands for hardware on a machine: the simulated GPU's state file, network namespaces.

The agent's probes, the worker SDK and the chaos injectors all touch these, so they sit
below all three.
"""
