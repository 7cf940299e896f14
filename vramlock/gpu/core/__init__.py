"""The swap engine's core, shared by the CUDA library (../swap) and the Vulkan layer
(../vulkan): C sources each library compiles in (cbuild.py), and ``protocol``, the
Python end of their conversation with vramlock run."""
