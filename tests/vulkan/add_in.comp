#version 450
// vk_prog's kernel with an input (VK_PROG_INPUT=ro): every word of the data buffer
// gains its word of the input, which the kernel declares readonly (never written).
layout(local_size_x = 64) in;
layout(std430, set = 0, binding = 0) buffer Data { uint words[]; };
layout(std430, set = 0, binding = 1) readonly buffer In { uint inc[]; };
layout(push_constant) uniform Count { uint n; };
void main()
{
    uint i = gl_GlobalInvocationID.x;
    if (i < n)
        words[i] += inc[i];
}
