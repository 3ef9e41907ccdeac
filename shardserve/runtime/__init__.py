"""Processes and Ray sessions: starting and stopping Ray, ports, /proc, warm workers."""
