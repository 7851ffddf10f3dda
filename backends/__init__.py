"""Engine backends: the only code that imports an engine. Each subpackage runs in its env."""
