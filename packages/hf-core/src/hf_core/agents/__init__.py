"""Multi-turn, tool-using rollouts: the sandbox, tools, environments, the agent loop and agent
functions run against the policy endpoint (the tool-call parser is :mod:`hf_core.tool_calls`)."""
