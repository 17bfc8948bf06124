"""Multi-turn, tool-using rollouts: the sandbox, tools, the tool-call parser and the agent loop."""
