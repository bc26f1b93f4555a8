"""How dzctl reaches a node: SSH (``pool``, ``connection``, ``sshconfig``, ``hostkeys``), the system's
OpenSSH client for bulk streams (``openssh``), and this machine without SSH (``local``).

The only package that imports paramiko. Commands are argv lists; ``connection.command_line`` is the
one place they become a shell string.
"""
