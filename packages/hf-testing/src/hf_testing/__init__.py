"""HybridFlow test support: tiny models and tasks, test clusters, the backend conformance kit.

Backends' test suites depend on this package; product packages never import it.
"""

__version__ = "0.1.0"
