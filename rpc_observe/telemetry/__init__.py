"""Telemetry of RPCs, with no torch import: the runtime of one worker, metrics and their
HTTP endpoint, span records and their exporters, the add-on's own health.

Fed by `rpc_observe.hooks`; never imports it, nor torch.
"""
