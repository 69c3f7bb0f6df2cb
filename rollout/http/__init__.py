"""The rollout side's HTTP layer, apart from the scheduling core it serves (the buffer, manager,
policies, rankers and dispatcher import none of it; tests/test_layering.py checks):

    protocol.py    SGLang's generate wire format, parsed and checked
    client.py      EngineClient: the Engines interface over the router and the engine servers
    router.py      the sglang-router process
    auth.py        the control token on the rollout side (headers, bind checks)
    token_exec.py  starts a server with the token off its command line
"""
