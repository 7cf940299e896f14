#version 450
// vk_prog's kernel: every word of the buffer one more (the program checks them all).
layout(local_size_x = 64) in;
layout(std430, set = 0, binding = 0) buffer Data { uint words[]; };
layout(push_constant) uniform Count { uint n; };
void main()
{
    uint i = gl_GlobalInvocationID.x;
    if (i < n)
        words[i] += 1u;
}
