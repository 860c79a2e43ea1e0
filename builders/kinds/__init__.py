"""Topology kinds: one module per kind (its spec section, its apps in the plan, its KubeRay parts, how status
describes it), listed in `registry.py`. Adding one: builders/README.md."""
