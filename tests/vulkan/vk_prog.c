/*
 * vk_prog: a small Vulkan compute program for the layer's tests. Its data buffer
 * (device memory, never mapped) starts as seed(i) in every word; each round a kernel
 * adds one to every word (its descriptor set written once, at the start, as
 * llama.cpp does), the buffer is copied to a staging buffer (mapped for good), and
 * every word is checked against seed(i) + rounds. A wrong word exits 2 with a line.
 *
 *   vk_prog WORDS            rounds until the file $VK_PROG_STOP exists
 *
 * It says `ready` once its buffers are made, then `done ROUNDS ok` at the end. It
 * sleeps VK_PROG_REST milliseconds between rounds (5 unless given: never idle long
 * enough for the layer to make a host copy ahead, ahead.c, which wants 50). With
 * VK_PROG_ONCE=1 its command buffer is one-time-submit; with VK_PROG_KEEP=1 it is
 * recorded once and submitted every round (the layer must refuse to swap that); with
 * VK_PROG_ADDRESS=1 it takes its data buffer's device address (VK_PROG_ADDRESS=12: the
 * same, bufferDeviceAddress asked through the 1.2 features, and first looked for there:
 * without it the program exits 4 with a line; VK_PROG_ADDRESS=opt: the same where the
 * device shows it, else none, as llama.cpp does; it then says `ready addresses` where
 * it took one). VK_PROG_APP names the program to Vulkan (VkApplicationInfo). With
 * VK_PROG_TYPES set
 * it prints the memory types it sees (`type INDEX FLAGS HEAP`) and what vkMapMemory
 * of its data memory returned (`map RESULT`), and exits.
 *
 * With VK_PROG_INPUT=ro it has an input buffer too (device memory, never mapped, twice
 * the data buffer's size, its first half read), filled once with input(i): the kernel
 * (add_in.comp) declares it readonly and adds input(i) to every word each round. With
 * VK_PROG_INPUT=rw the kernel (add_in_rw.comp) declares it writable and adds one to
 * each of its words before adding it: after r rounds a word is seed(i) + r * input(i)
 * + r (r + 1) / 2, right only if the input kept every change.
 *
 * With VK_PROG_RECORD=N it times its recording, as llama.cpp records, and exits: N
 * dispatches in one command buffer, each with a descriptor set of its own (written
 * once), a pipeline bound, push constants and a barrier, the buffer then submitted;
 * after 5 rounds unmeasured, 50 measured, it prints `record NS ns per dispatch` (the
 * median of the time from vkBeginCommandBuffer to vkQueueSubmit's return, over N).
 *
 * With VK_PROG_START_MS it waits that many milliseconds before it makes its device (as
 * a GPU driver's start takes a while).
 *
 * With VK_PROG_FORK=1 it forks once its device is made and it holds an allocation on
 * it (device memory, as large as its data buffer, kept to the end): the child, whose
 * witness lines go to $WITNESS_LOG.child, makes a device of its own (a Vulkan device
 * is not a forked child's to use) and runs as its parent does, both saying `ready` and
 * `done ROUNDS ok`; the child then ends by _exit (the driver's exit handlers would wait
 * for threads of its parent's), and the parent, after its own end, waits for it and
 * exits 5 with a line where it failed.
 *
 * With VK_PROG_SYNC2=1 it takes Vulkan 1.3's ways (synchronization2 enabled): its
 * descriptor set is written through a descriptor update template, and each round the
 * kernel's output goes through a mirror buffer (device memory, never mapped, twice the
 * data buffer's size, its first half written only by vkCmdCopyBuffer2) to the staging
 * buffer, with vkCmdPipelineBarrier2 between, submitted with vkQueueSubmit2. An entry
 * point it does not get exits 4 with a line.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <vulkan/vulkan.h>

#include "add_in_rw_spv.h"
#include "add_in_spv.h"
#include "add_one_spv.h"

#define CHECK(call)                                                            \
	do {                                                                   \
		VkResult r_ = (call);                                          \
		if (r_ != VK_SUCCESS) {                                        \
			fprintf(stderr, "vk_prog: %s failed: %d\n", #call, r_); \
			exit(3);                                               \
		}                                                              \
	} while (0)

static VkDevice dev;
static VkBuffer in_buf; /* VK_PROG_INPUT's */
static VkPhysicalDevice phys;
static int address; /* VK_PROG_ADDRESS: 1, or 12 (through the 1.2 features), 13: opt */
static int sync2;   /* VK_PROG_SYNC2 */
static int input;   /* VK_PROG_INPUT: 0 none, 1 ro, 2 rw */

static uint32_t seed(uint32_t i)
{
	return i * 2654435761u;
}

static uint32_t input_word(uint32_t i)
{
	return i % 7 + 1;
}

/* Word i after `rounds` rounds. */
static uint32_t expected(uint32_t i, uint32_t rounds)
{
	if (!input)
		return seed(i) + rounds;
	uint32_t more = input == 2 ? rounds * (rounds + 1) / 2 : 0;
	return seed(i) + rounds * input_word(i) + more;
}

static uint32_t memory_type(uint32_t bits, VkMemoryPropertyFlags want)
{
	VkPhysicalDeviceMemoryProperties p;
	vkGetPhysicalDeviceMemoryProperties(phys, &p);
	for (uint32_t t = 0; t < p.memoryTypeCount; t++)
		if ((bits & (1u << t)) && (p.memoryTypes[t].propertyFlags & want) == want)
			return t;
	fprintf(stderr, "vk_prog: no memory type\n");
	exit(3);
}

static VkBuffer buffer(VkDeviceSize size, VkBufferUsageFlags usage, VkDeviceMemory *mem,
		       VkMemoryPropertyFlags want)
{
	VkBufferCreateInfo bi = {.sType = VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO, .size = size,
				 .usage = usage, .sharingMode = VK_SHARING_MODE_EXCLUSIVE};
	VkBuffer b;
	VkMemoryRequirements req;
	CHECK(vkCreateBuffer(dev, &bi, NULL, &b));
	vkGetBufferMemoryRequirements(dev, b, &req);
	VkMemoryAllocateFlagsInfo flags = {.sType = VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_FLAGS_INFO,
					   .flags = VK_MEMORY_ALLOCATE_DEVICE_ADDRESS_BIT};
	VkMemoryAllocateInfo ai = {.sType = VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO,
				   .pNext = usage & VK_BUFFER_USAGE_SHADER_DEVICE_ADDRESS_BIT ? &flags : NULL,
				   .allocationSize = req.size,
				   .memoryTypeIndex = memory_type(req.memoryTypeBits, want)};
	CHECK(vkAllocateMemory(dev, &ai, NULL, mem));
	CHECK(vkBindBufferMemory(dev, b, *mem, 0));
	return b;
}

/* The memory types a storage buffer of `size` bytes may take. */
static uint32_t bits_of(VkDeviceSize size)
{
	VkBufferCreateInfo bi = {.sType = VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO, .size = size,
				 .usage = VK_BUFFER_USAGE_STORAGE_BUFFER_BIT,
				 .sharingMode = VK_SHARING_MODE_EXCLUSIVE};
	VkBuffer b;
	VkMemoryRequirements req;
	CHECK(vkCreateBuffer(dev, &bi, NULL, &b));
	vkGetBufferMemoryRequirements(dev, b, &req);
	vkDestroyBuffer(dev, b, NULL);
	return req.memoryTypeBits;
}

/* VK_PROG_TYPES: the types a 4 KiB and a 1 GiB buffer may take (`bits SMALL BIG`); a
 * 4 KiB buffer in device-local memory it may map, as llama.cpp asks for it, and what
 * mapping it returned (`small map RESULT`); and the 4 KiB buffer's types after. */
static void allowance(void)
{
	VkDeviceMemory mem;
	void *at;
	printf("bits %#x %#x\n", bits_of(4096), bits_of(1ull << 30));
	buffer(4096, VK_BUFFER_USAGE_STORAGE_BUFFER_BIT, &mem,
	       VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT | VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT |
		       VK_MEMORY_PROPERTY_HOST_COHERENT_BIT);
	printf("small map %d\n", (int)vkMapMemory(dev, mem, 0, VK_WHOLE_SIZE, 0, &at));
	printf("bits %#x\n", bits_of(4096));
}

/* bufferDeviceAddress through the 1.2 features: looked for, and enabled. */
static void *addresses_12(VkPhysicalDeviceVulkan12Features *v12)
{
	VkPhysicalDeviceFeatures2 f = {.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2,
				       .pNext = v12};
	memset(v12, 0, sizeof *v12);
	v12->sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_FEATURES;
	vkGetPhysicalDeviceFeatures2(phys, &f);
	if (!v12->bufferDeviceAddress && address == 13) {
		address = 0; /* none shown: it goes on without */
		return NULL;
	}
	if (!v12->bufferDeviceAddress) {
		fprintf(stderr, "vk_prog: the device shows no bufferDeviceAddress\n");
		exit(4);
	}
	memset(v12, 0, sizeof *v12);
	v12->sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_FEATURES;
	v12->bufferDeviceAddress = VK_TRUE;
	return v12;
}

static void make_device(VkQueue *queue)
{
	VkApplicationInfo app = {.sType = VK_STRUCTURE_TYPE_APPLICATION_INFO,
				 .pApplicationName = getenv("VK_PROG_APP"),
				 .apiVersion = sync2 ? VK_API_VERSION_1_3 : VK_API_VERSION_1_2};
	VkInstanceCreateInfo ici = {.sType = VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO,
				    .pApplicationInfo = &app};
	VkInstance inst;
	uint32_t n = 1;
	CHECK(vkCreateInstance(&ici, NULL, &inst));
	VkResult r = vkEnumeratePhysicalDevices(inst, &n, &phys);
	if (r != VK_SUCCESS && r != VK_INCOMPLETE)
		CHECK(r);
	float prio = 1.0f;
	VkDeviceQueueCreateInfo q = {.sType = VK_STRUCTURE_TYPE_DEVICE_QUEUE_CREATE_INFO,
				     .queueFamilyIndex = 0, .queueCount = 1,
				     .pQueuePriorities = &prio};
	VkPhysicalDeviceBufferDeviceAddressFeatures bda = {
		.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_BUFFER_DEVICE_ADDRESS_FEATURES,
		.bufferDeviceAddress = VK_TRUE};
	VkPhysicalDeviceVulkan12Features v12;
	VkPhysicalDeviceVulkan13Features v13 = {
		.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_3_FEATURES,
		.synchronization2 = VK_TRUE};
	VkDeviceCreateInfo dci = {.sType = VK_STRUCTURE_TYPE_DEVICE_CREATE_INFO,
				  .pNext = address >= 12 ? addresses_12(&v12)
					   : address    ? (void *)&bda
					   : sync2      ? (void *)&v13
							: NULL,
				  .queueCreateInfoCount = 1, .pQueueCreateInfos = &q};
	CHECK(vkCreateDevice(phys, &dci, NULL, &dev));
	vkGetDeviceQueue(dev, 0, 0, queue);
}

/* Vulkan 1.3's entry points (VK_PROG_SYNC2), each from vkGetDeviceProcAddr. */
static struct {
	PFN_vkCmdCopyBuffer2 copy;
	PFN_vkCmdPipelineBarrier2 barrier;
	PFN_vkQueueSubmit2 submit;
	PFN_vkCreateDescriptorUpdateTemplate create_template;
	PFN_vkUpdateDescriptorSetWithTemplate update;
} v13;

static PFN_vkVoidFunction entry(const char *name)
{
	PFN_vkVoidFunction fn = vkGetDeviceProcAddr(dev, name);
	if (!fn) {
		fprintf(stderr, "vk_prog: no %s\n", name);
		exit(4);
	}
	return fn;
}

static void load_v13(void)
{
	v13.copy = (PFN_vkCmdCopyBuffer2)entry("vkCmdCopyBuffer2");
	v13.barrier = (PFN_vkCmdPipelineBarrier2)entry("vkCmdPipelineBarrier2");
	v13.submit = (PFN_vkQueueSubmit2)entry("vkQueueSubmit2");
	v13.create_template =
		(PFN_vkCreateDescriptorUpdateTemplate)entry("vkCreateDescriptorUpdateTemplate");
	v13.update =
		(PFN_vkUpdateDescriptorSetWithTemplate)entry("vkUpdateDescriptorSetWithTemplate");
}

struct kernel {
	VkPipeline pipe;
	VkPipelineLayout layout;
	VkDescriptorSetLayout sl;
	VkDescriptorSet set;
};

/* The set's `nb` buffers written through an update template, from raw data where each
 * buffer's info sits at 8 bytes into a record of 32. */
static void write_by_template(VkDescriptorSet set, VkDescriptorSetLayout layout,
			      const VkDescriptorBufferInfo *info, uint32_t nb)
{
	struct {
		uint64_t pad;
		VkDescriptorBufferInfo info;
	} raw[2];
	for (uint32_t i = 0; i < nb; i++)
		raw[i].pad = 0, raw[i].info = info[i];
	VkDescriptorUpdateTemplateEntry e = {0, 0, nb, VK_DESCRIPTOR_TYPE_STORAGE_BUFFER, 8,
					     sizeof raw[0]};
	VkDescriptorUpdateTemplateCreateInfo ci = {
		.sType = VK_STRUCTURE_TYPE_DESCRIPTOR_UPDATE_TEMPLATE_CREATE_INFO,
		.descriptorUpdateEntryCount = 1, .pDescriptorUpdateEntries = &e,
		.templateType = VK_DESCRIPTOR_UPDATE_TEMPLATE_TYPE_DESCRIPTOR_SET,
		.descriptorSetLayout = layout};
	VkDescriptorUpdateTemplate t;
	CHECK(v13.create_template(dev, &ci, NULL, &t));
	v13.update(dev, set, t, raw);
}

static struct kernel make_kernel(VkBuffer data, VkBuffer in)
{
	struct kernel k;
	uint32_t nb = input ? 2 : 1;
	VkDescriptorSetLayoutBinding b[2] = {
		{0, VK_DESCRIPTOR_TYPE_STORAGE_BUFFER, 1, VK_SHADER_STAGE_COMPUTE_BIT, NULL},
		{1, VK_DESCRIPTOR_TYPE_STORAGE_BUFFER, 1, VK_SHADER_STAGE_COMPUTE_BIT, NULL}};
	VkDescriptorSetLayoutCreateInfo li = {
		.sType = VK_STRUCTURE_TYPE_DESCRIPTOR_SET_LAYOUT_CREATE_INFO, .bindingCount = nb,
		.pBindings = b};
	VkDescriptorSetLayout sl;
	CHECK(vkCreateDescriptorSetLayout(dev, &li, NULL, &sl));
	k.sl = sl;
	VkPushConstantRange pc = {VK_SHADER_STAGE_COMPUTE_BIT, 0, 4};
	VkPipelineLayoutCreateInfo pli = {.sType = VK_STRUCTURE_TYPE_PIPELINE_LAYOUT_CREATE_INFO,
					  .setLayoutCount = 1, .pSetLayouts = &sl,
					  .pushConstantRangeCount = 1, .pPushConstantRanges = &pc};
	CHECK(vkCreatePipelineLayout(dev, &pli, NULL, &k.layout));
	VkShaderModuleCreateInfo si = {.sType = VK_STRUCTURE_TYPE_SHADER_MODULE_CREATE_INFO,
				       .codeSize = sizeof ADD_ONE_SPV, .pCode = ADD_ONE_SPV};
	if (input == 1)
		si.codeSize = sizeof ADD_IN_SPV, si.pCode = ADD_IN_SPV;
	else if (input == 2)
		si.codeSize = sizeof ADD_IN_RW_SPV, si.pCode = ADD_IN_RW_SPV;
	VkShaderModule sm;
	CHECK(vkCreateShaderModule(dev, &si, NULL, &sm));
	VkComputePipelineCreateInfo ci = {
		.sType = VK_STRUCTURE_TYPE_COMPUTE_PIPELINE_CREATE_INFO,
		.stage = {.sType = VK_STRUCTURE_TYPE_PIPELINE_SHADER_STAGE_CREATE_INFO,
			  .stage = VK_SHADER_STAGE_COMPUTE_BIT, .module = sm, .pName = "main"},
		.layout = k.layout};
	CHECK(vkCreateComputePipelines(dev, VK_NULL_HANDLE, 1, &ci, NULL, &k.pipe));
	VkDescriptorPoolSize ps = {VK_DESCRIPTOR_TYPE_STORAGE_BUFFER, nb};
	VkDescriptorPoolCreateInfo pi = {.sType = VK_STRUCTURE_TYPE_DESCRIPTOR_POOL_CREATE_INFO,
					 .maxSets = 1, .poolSizeCount = 1, .pPoolSizes = &ps};
	VkDescriptorPool pool;
	CHECK(vkCreateDescriptorPool(dev, &pi, NULL, &pool));
	VkDescriptorSetAllocateInfo ai = {.sType = VK_STRUCTURE_TYPE_DESCRIPTOR_SET_ALLOCATE_INFO,
					  .descriptorPool = pool, .descriptorSetCount = 1,
					  .pSetLayouts = &sl};
	CHECK(vkAllocateDescriptorSets(dev, &ai, &k.set));
	VkDescriptorBufferInfo info[2] = {{data, 0, VK_WHOLE_SIZE}, {in, 0, VK_WHOLE_SIZE}};
	if (sync2) {
		write_by_template(k.set, sl, info, nb);
		return k;
	}
	VkWriteDescriptorSet w = {.sType = VK_STRUCTURE_TYPE_WRITE_DESCRIPTOR_SET,
				  .dstSet = k.set, .descriptorCount = nb,
				  .descriptorType = VK_DESCRIPTOR_TYPE_STORAGE_BUFFER,
				  .pBufferInfo = info};
	vkUpdateDescriptorSets(dev, 1, &w, 0, NULL);
	return k;
}

/* One round: add one to every word, copy the buffer to `staging`. */
static void record(VkCommandBuffer cb, struct kernel *k, VkBuffer data, VkBuffer staging,
		   uint32_t words, int flags)
{
	VkCommandBufferBeginInfo bi = {.sType = VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO,
				       .flags = (VkCommandBufferUsageFlags)flags};
	CHECK(vkBeginCommandBuffer(cb, &bi));
	vkCmdBindPipeline(cb, VK_PIPELINE_BIND_POINT_COMPUTE, k->pipe);
	vkCmdBindDescriptorSets(cb, VK_PIPELINE_BIND_POINT_COMPUTE, k->layout, 0, 1, &k->set, 0,
				NULL);
	vkCmdPushConstants(cb, k->layout, VK_SHADER_STAGE_COMPUTE_BIT, 0, 4, &words);
	vkCmdDispatch(cb, (words + 63) / 64, 1, 1);
	VkBufferMemoryBarrier bar = {.sType = VK_STRUCTURE_TYPE_BUFFER_MEMORY_BARRIER,
				     .srcAccessMask = VK_ACCESS_SHADER_WRITE_BIT,
				     .dstAccessMask = VK_ACCESS_TRANSFER_READ_BIT,
				     .srcQueueFamilyIndex = VK_QUEUE_FAMILY_IGNORED,
				     .dstQueueFamilyIndex = VK_QUEUE_FAMILY_IGNORED,
				     .buffer = data, .size = VK_WHOLE_SIZE};
	vkCmdPipelineBarrier(cb, VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT,
			     VK_PIPELINE_STAGE_TRANSFER_BIT, 0, 0, NULL, 1, &bar, 0, NULL);
	VkBufferCopy region = {0, 0, (VkDeviceSize)words * 4};
	vkCmdCopyBuffer(cb, data, staging, 1, &region);
	CHECK(vkEndCommandBuffer(cb));
}

static void barrier2(VkCommandBuffer cb, VkBuffer buf, VkPipelineStageFlags2 src_stage,
		     VkAccessFlags2 src)
{
	VkBufferMemoryBarrier2 bar = {.sType = VK_STRUCTURE_TYPE_BUFFER_MEMORY_BARRIER_2,
				      .srcStageMask = src_stage, .srcAccessMask = src,
				      .dstStageMask = VK_PIPELINE_STAGE_2_COPY_BIT,
				      .dstAccessMask = VK_ACCESS_2_TRANSFER_READ_BIT,
				      .srcQueueFamilyIndex = VK_QUEUE_FAMILY_IGNORED,
				      .dstQueueFamilyIndex = VK_QUEUE_FAMILY_IGNORED,
				      .buffer = buf, .size = VK_WHOLE_SIZE};
	VkDependencyInfo dep = {.sType = VK_STRUCTURE_TYPE_DEPENDENCY_INFO,
				.bufferMemoryBarrierCount = 1, .pBufferMemoryBarriers = &bar};
	v13.barrier(cb, &dep);
}

static void copy2(VkCommandBuffer cb, VkBuffer src, VkBuffer dst, VkDeviceSize bytes)
{
	VkBufferCopy2 region = {.sType = VK_STRUCTURE_TYPE_BUFFER_COPY_2, .size = bytes};
	VkCopyBufferInfo2 info = {.sType = VK_STRUCTURE_TYPE_COPY_BUFFER_INFO_2, .srcBuffer = src,
				  .dstBuffer = dst, .regionCount = 1, .pRegions = &region};
	v13.copy(cb, &info);
}

/* One round the 1.3 way (VK_PROG_SYNC2): add one to every word, copy the buffer to
 * the mirror, the mirror to `staging`. */
static void record2(VkCommandBuffer cb, struct kernel *k, VkBuffer data, VkBuffer mirror,
		    VkBuffer staging, uint32_t words)
{
	VkCommandBufferBeginInfo bi = {.sType = VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO};
	CHECK(vkBeginCommandBuffer(cb, &bi));
	vkCmdBindPipeline(cb, VK_PIPELINE_BIND_POINT_COMPUTE, k->pipe);
	vkCmdBindDescriptorSets(cb, VK_PIPELINE_BIND_POINT_COMPUTE, k->layout, 0, 1, &k->set, 0,
				NULL);
	vkCmdPushConstants(cb, k->layout, VK_SHADER_STAGE_COMPUTE_BIT, 0, 4, &words);
	vkCmdDispatch(cb, (words + 63) / 64, 1, 1);
	barrier2(cb, data, VK_PIPELINE_STAGE_2_COMPUTE_SHADER_BIT, VK_ACCESS_2_SHADER_WRITE_BIT);
	copy2(cb, data, mirror, (VkDeviceSize)words * 4);
	barrier2(cb, mirror, VK_PIPELINE_STAGE_2_COPY_BIT, VK_ACCESS_2_TRANSFER_WRITE_BIT);
	copy2(cb, mirror, staging, (VkDeviceSize)words * 4);
	CHECK(vkEndCommandBuffer(cb));
}

static void submit(VkQueue q, VkCommandBuffer cb, VkFence fence)
{
	if (!sync2) {
		VkSubmitInfo si = {.sType = VK_STRUCTURE_TYPE_SUBMIT_INFO,
				   .commandBufferCount = 1, .pCommandBuffers = &cb};
		CHECK(vkQueueSubmit(q, 1, &si, fence));
		return;
	}
	VkCommandBufferSubmitInfo ci = {.sType = VK_STRUCTURE_TYPE_COMMAND_BUFFER_SUBMIT_INFO,
					.commandBuffer = cb};
	VkSubmitInfo2 si = {.sType = VK_STRUCTURE_TYPE_SUBMIT_INFO_2,
			    .commandBufferInfoCount = 1, .pCommandBufferInfos = &ci};
	CHECK(v13.submit(q, 1, &si, fence));
}

/* The data buffer starts as seed(i), the input's words (from `at`) as input(i):
 * written through the staging buffer, copied. */
static void fill(VkQueue q, VkCommandBuffer cb, VkBuffer data, VkBuffer staging, uint32_t *seen,
		 uint32_t words, uint32_t at)
{
	for (uint32_t i = 0; i < words; i++)
		seen[i] = data ? seed(i) : input_word(at + i);
	VkCommandBufferBeginInfo bi = {.sType = VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO,
				       .flags = VK_COMMAND_BUFFER_USAGE_ONE_TIME_SUBMIT_BIT};
	CHECK(vkBeginCommandBuffer(cb, &bi));
	VkBufferCopy region = {0, (VkDeviceSize)at * 4, (VkDeviceSize)words * 4};
	vkCmdCopyBuffer(cb, staging, data ? data : in_buf, 1, &region);
	CHECK(vkEndCommandBuffer(cb));
	VkSubmitInfo si = {.sType = VK_STRUCTURE_TYPE_SUBMIT_INFO, .commandBufferCount = 1,
			   .pCommandBuffers = &cb};
	CHECK(vkQueueSubmit(q, 1, &si, VK_NULL_HANDLE));
	CHECK(vkQueueWaitIdle(q));
	CHECK(vkResetCommandBuffer(cb, 0));
}

static void check(const uint32_t *seen, uint32_t words, unsigned rounds)
{
	for (uint32_t i = 0; i < words; i++)
		if (seen[i] != expected(i, rounds)) {
			fprintf(stderr, "vk_prog: word %u is %u after %u rounds, not %u\n", i,
				seen[i], rounds, expected(i, rounds));
			exit(2);
		}
}

static int by_value(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return (x > y) - (x < y);
}

static void sleep_ms(long ms)
{
	struct timespec t = {ms / 1000, ms % 1000 * 1000000};
	nanosleep(&t, NULL);
}

static double seconds(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

/* VK_PROG_RECORD=n: `n` sets made and written, the rounds recorded and timed. */
static void bench_record(VkQueue q, VkCommandBuffer cb, VkFence fence, struct kernel *k,
			 VkBuffer data, uint32_t n)
{
	VkDescriptorPoolSize ps = {VK_DESCRIPTOR_TYPE_STORAGE_BUFFER, 2 * n};
	VkDescriptorPoolCreateInfo pi = {.sType = VK_STRUCTURE_TYPE_DESCRIPTOR_POOL_CREATE_INFO,
					 .maxSets = n, .poolSizeCount = 1, .pPoolSizes = &ps};
	VkDescriptorPool pool;
	CHECK(vkCreateDescriptorPool(dev, &pi, NULL, &pool));
	VkDescriptorSet *sets = calloc(n, sizeof *sets);
	for (uint32_t i = 0; sets && i < n; i++) {
		VkDescriptorSetAllocateInfo ai = {
			.sType = VK_STRUCTURE_TYPE_DESCRIPTOR_SET_ALLOCATE_INFO,
			.descriptorPool = pool, .descriptorSetCount = 1, .pSetLayouts = &k->sl};
		CHECK(vkAllocateDescriptorSets(dev, &ai, &sets[i]));
		VkDescriptorBufferInfo info[2] = {{data, 0, VK_WHOLE_SIZE},
						  {in_buf, 0, VK_WHOLE_SIZE}};
		VkWriteDescriptorSet w = {.sType = VK_STRUCTURE_TYPE_WRITE_DESCRIPTOR_SET,
					  .dstSet = sets[i], .descriptorCount = input ? 2 : 1,
					  .descriptorType = VK_DESCRIPTOR_TYPE_STORAGE_BUFFER,
					  .pBufferInfo = info};
		vkUpdateDescriptorSets(dev, 1, &w, 0, NULL);
	}
	double took[55];
	uint32_t words = 64;
	VkMemoryBarrier bar = {.sType = VK_STRUCTURE_TYPE_MEMORY_BARRIER,
			       .srcAccessMask = VK_ACCESS_SHADER_WRITE_BIT,
			       .dstAccessMask = VK_ACCESS_SHADER_READ_BIT};
	VkCommandBufferBeginInfo bi = {.sType = VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO,
				       .flags = VK_COMMAND_BUFFER_USAGE_ONE_TIME_SUBMIT_BIT};
	for (int round = 0; sets && round < 55; round++) {
		double t0 = seconds();
		CHECK(vkBeginCommandBuffer(cb, &bi));
		for (uint32_t i = 0; i < n; i++) {
			vkCmdPushConstants(cb, k->layout, VK_SHADER_STAGE_COMPUTE_BIT, 0, 4, &words);
			vkCmdBindPipeline(cb, VK_PIPELINE_BIND_POINT_COMPUTE, k->pipe);
			vkCmdBindDescriptorSets(cb, VK_PIPELINE_BIND_POINT_COMPUTE, k->layout, 0,
						1, &sets[i], 0, NULL);
			vkCmdDispatch(cb, 1, 1, 1);
			vkCmdPipelineBarrier(cb, VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT,
					     VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT, 0, 1, &bar, 0,
					     NULL, 0, NULL);
		}
		CHECK(vkEndCommandBuffer(cb));
		submit(q, cb, fence);
		took[round] = (seconds() - t0) / n;
		CHECK(vkWaitForFences(dev, 1, &fence, VK_TRUE, UINT64_MAX));
		CHECK(vkResetFences(dev, 1, &fence));
	}
	if (!sets)
		exit(3);
	qsort(took + 5, 50, sizeof *took, by_value);
	printf("record %.1f ns per dispatch\n", took[5 + 25] * 1e9);
	exit(0);
}

/* VK_PROG_FORK=1: an allocation made (the parent's to the end), then a fork; the child
 * makes a device of its own, its witness lines going to a log of its own. 0 in the
 * child, the child's pid in the parent. */
static pid_t fork_after_making(VkQueue *q, uint32_t words)
{
	VkDeviceMemory kept;
	buffer((VkDeviceSize)words * 4, VK_BUFFER_USAGE_STORAGE_BUFFER_BIT, &kept,
	       VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT);
	fflush(stdout);
	pid_t pid = fork();
	if (pid < 0)
		exit(3);
	if (pid == 0) {
		const char *log = getenv("WITNESS_LOG");
		char own[4096];
		if (log && snprintf(own, sizeof own, "%s.child", log) < (int)sizeof own)
			setenv("WITNESS_LOG", own, 1);
		make_device(q);
	}
	return pid;
}

/* The parent of VK_PROG_FORK=1, at its end: 0 where the child ended well. */
static int child_failed(pid_t child)
{
	int status = 0;
	if (waitpid(child, &status, 0) == child && WIFEXITED(status) && !WEXITSTATUS(status))
		return 0;
	fprintf(stderr, "vk_prog: the child failed (status %#x)\n", status);
	return 5;
}

int main(int argc, char **argv)
{
	uint32_t words = argc > 1 ? (uint32_t)strtoul(argv[1], NULL, 10) : 1 << 20;
	const char *stop = getenv("VK_PROG_STOP");
	int keep = getenv("VK_PROG_KEEP") && !strcmp(getenv("VK_PROG_KEEP"), "1");
	int once = getenv("VK_PROG_ONCE") && !strcmp(getenv("VK_PROG_ONCE"), "1");
	long rest = getenv("VK_PROG_REST") ? strtol(getenv("VK_PROG_REST"), NULL, 10) : 5;
	const char *wants = getenv("VK_PROG_ADDRESS");
	address = !wants		 ? 0
		  : !strcmp(wants, "1")	 ? 1
		  : !strcmp(wants, "12") ? 12
		  : !strcmp(wants, "opt") ? 13
					 : 0;
	sync2 = getenv("VK_PROG_SYNC2") && !strcmp(getenv("VK_PROG_SYNC2"), "1");
	const char *in = getenv("VK_PROG_INPUT");
	input = !in ? 0 : !strcmp(in, "ro") ? 1 : !strcmp(in, "rw") ? 2 : 0;
	if (getenv("VK_PROG_START_MS"))
		sleep_ms(strtol(getenv("VK_PROG_START_MS"), NULL, 10));
	VkQueue q;
	make_device(&q);
	pid_t child = -1;
	if (getenv("VK_PROG_FORK") && !strcmp(getenv("VK_PROG_FORK"), "1"))
		child = fork_after_making(&q, words);
	if (sync2)
		load_v13();
	VkDeviceMemory data_mem, staging_mem;
	VkBuffer data = buffer((VkDeviceSize)words * 4,
			       VK_BUFFER_USAGE_STORAGE_BUFFER_BIT | VK_BUFFER_USAGE_TRANSFER_SRC_BIT |
				       VK_BUFFER_USAGE_TRANSFER_DST_BIT |
				       (address ? VK_BUFFER_USAGE_SHADER_DEVICE_ADDRESS_BIT : 0),
			       &data_mem, VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT);
	if (getenv("VK_PROG_TYPES")) { /* the memory types it sees, and a map of its data */
		VkPhysicalDeviceMemoryProperties p;
		void *at;
		vkGetPhysicalDeviceMemoryProperties(phys, &p);
		for (uint32_t t = 0; t < p.memoryTypeCount; t++)
			printf("type %u %#x %u\n", t, (unsigned)p.memoryTypes[t].propertyFlags,
			       p.memoryTypes[t].heapIndex);
		printf("map %d\n", (int)vkMapMemory(dev, data_mem, 0, VK_WHOLE_SIZE, 0, &at));
		allowance();
		return 0;
	}
	if (address) {
		VkBufferDeviceAddressInfo where = {
			.sType = VK_STRUCTURE_TYPE_BUFFER_DEVICE_ADDRESS_INFO, .buffer = data};
		if (!vkGetBufferDeviceAddress(dev, &where))
			return 3;
	}
	VkBuffer staging = buffer((VkDeviceSize)words * 4,
				  VK_BUFFER_USAGE_TRANSFER_SRC_BIT | VK_BUFFER_USAGE_TRANSFER_DST_BIT,
				  &staging_mem, VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT |
							VK_MEMORY_PROPERTY_HOST_COHERENT_BIT);
	uint32_t *seen;
	CHECK(vkMapMemory(dev, staging_mem, 0, VK_WHOLE_SIZE, 0, (void **)&seen));
	VkCommandPoolCreateInfo pci = {.sType = VK_STRUCTURE_TYPE_COMMAND_POOL_CREATE_INFO,
				       .flags = VK_COMMAND_POOL_CREATE_RESET_COMMAND_BUFFER_BIT};
	VkCommandPool pool;
	CHECK(vkCreateCommandPool(dev, &pci, NULL, &pool));
	VkCommandBufferAllocateInfo cai = {.sType = VK_STRUCTURE_TYPE_COMMAND_BUFFER_ALLOCATE_INFO,
					   .commandPool = pool,
					   .level = VK_COMMAND_BUFFER_LEVEL_PRIMARY,
					   .commandBufferCount = 1};
	VkCommandBuffer cb;
	CHECK(vkAllocateCommandBuffers(dev, &cai, &cb));
	VkDeviceMemory in_mem = VK_NULL_HANDLE;
	if (input) {
		in_buf = buffer((VkDeviceSize)words * 8,
				VK_BUFFER_USAGE_STORAGE_BUFFER_BIT | VK_BUFFER_USAGE_TRANSFER_DST_BIT,
				&in_mem, VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT);
		fill(q, cb, VK_NULL_HANDLE, staging, seen, words, 0);
		fill(q, cb, VK_NULL_HANDLE, staging, seen, words, words);
	}
	fill(q, cb, data, staging, seen, words, 0);
	VkDeviceMemory mirror_mem = VK_NULL_HANDLE;
	VkBuffer mirror = VK_NULL_HANDLE;
	if (sync2)
		mirror = buffer((VkDeviceSize)words * 8,
				VK_BUFFER_USAGE_TRANSFER_SRC_BIT | VK_BUFFER_USAGE_TRANSFER_DST_BIT,
				&mirror_mem, VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT);
	struct kernel k = make_kernel(data, in_buf);
	VkFenceCreateInfo fi = {.sType = VK_STRUCTURE_TYPE_FENCE_CREATE_INFO};
	VkFence fence;
	CHECK(vkCreateFence(dev, &fi, NULL, &fence));
	if (getenv("VK_PROG_RECORD"))
		bench_record(q, cb, fence, &k, data,
			     (uint32_t)strtoul(getenv("VK_PROG_RECORD"), NULL, 10));
	printf(wants && !strcmp(wants, "opt") && address ? "ready addresses\n" : "ready\n");
	fflush(stdout);
	unsigned rounds = 0;
	int flags = once ? VK_COMMAND_BUFFER_USAGE_ONE_TIME_SUBMIT_BIT : 0;
	if (keep)
		record(cb, &k, data, staging, words, 0);
	do { /* one round at least */
		if (sync2)
			record2(cb, &k, data, mirror, staging, words);
		else if (!keep)
			record(cb, &k, data, staging, words, flags);
		submit(q, cb, fence);
		CHECK(vkWaitForFences(dev, 1, &fence, VK_TRUE, UINT64_MAX));
		CHECK(vkResetFences(dev, 1, &fence));
		if (!keep)
			CHECK(vkResetCommandBuffer(cb, 0));
		check(seen, words, ++rounds);
		sleep_ms(rest);
	} while (!stop || access(stop, F_OK));
	vkDestroyFence(dev, fence, NULL);
	vkDestroyBuffer(dev, data, NULL);
	vkFreeMemory(dev, data_mem, NULL);
	if (sync2) {
		vkDestroyBuffer(dev, mirror, NULL);
		vkFreeMemory(dev, mirror_mem, NULL);
	}
	if (input) {
		vkDestroyBuffer(dev, in_buf, NULL);
		vkFreeMemory(dev, in_mem, NULL);
	}
	printf("done %u ok\n", rounds);
	fflush(stdout);
	if (!child) /* its exit handlers would wait for threads of its parent's driver */
		_exit(0);
	return child > 0 ? child_failed(child) : 0;
}
