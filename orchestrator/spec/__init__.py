"""What the user wrote: the job spec (``job``), its YAML with line numbers (``yamlsource``), the hostfile.

Strict at load: every error names the file, the line and the key, with a did-you-mean.
Nothing here reads a node or decides an ``auto``.
"""
