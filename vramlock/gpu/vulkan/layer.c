/*
 * layer.c: the loader's interface (vklayer.h says how the parts fit): instance and
 * device creation down the chain, each device's table of the next layer's entry
 * points, and which entry points the program gets from us.
 */
#include "vklayer.h"

/* ---- instance ---------------------------------------------------------------- */

/* Programs that take their way without buffer device addresses and sparse binding
 * where the device has none, by the name they give Vulkan (VkApplicationInfo):
 * llama.cpp's Vulkan backend (ggml-vulkan) uses addresses only for its im2col kernels,
 * which have a form without, and for NVIDIA's cooperative matrices 2, which it then
 * leaves for its other kernels; it never makes a sparse resource, but enables every
 * feature the device reports (NVIDIA's drivers report sparse binding). */
static const char *const WITHOUT_ADDRESSES[] = {"ggml-vulkan"};

static int goes_without_addresses(const VkInstanceCreateInfo *ci)
{
	const VkApplicationInfo *app = ci->pApplicationInfo;
	for (size_t k = 0; app && k < sizeof WITHOUT_ADDRESSES / sizeof *WITHOUT_ADDRESSES; k++)
		if ((app->pApplicationName && !strcmp(app->pApplicationName, WITHOUT_ADDRESSES[k])) ||
		    (app->pEngineName && !strcmp(app->pEngineName, WITHOUT_ADDRESSES[k])))
			return 1;
	return 0;
}

static VKAPI_ATTR VkResult VKAPI_CALL create_instance(const VkInstanceCreateInfo *ci,
						      const VkAllocationCallbacks *alloc,
						      VkInstance *out)
{
	VkLayerInstanceCreateInfo *link = (VkLayerInstanceCreateInfo *)ci->pNext;
	while (link && !(link->sType == VK_STRUCTURE_TYPE_LOADER_INSTANCE_CREATE_INFO &&
			 link->function == VK_LAYER_LINK_INFO))
		link = (VkLayerInstanceCreateInfo *)link->pNext;
	if (!link)
		return VK_ERROR_INITIALIZATION_FAILED;
	PFN_vkGetInstanceProcAddr gipa = link->u.pLayerInfo->pfnNextGetInstanceProcAddr;
	link->u.pLayerInfo = link->u.pLayerInfo->pNext;
	PFN_vkCreateInstance create = (PFN_vkCreateInstance)gipa(NULL, "vkCreateInstance");
	VkResult r = create(ci, alloc, out);
	if (r != VK_SUCCESS)
		return r;
	struct vinst *i = calloc(1, sizeof *i);
	if (!i)
		return VK_ERROR_OUT_OF_HOST_MEMORY;
	i->key = key_of(*out);
	i->inst = *out;
	i->gipa = gipa;
	i->without_addresses = goes_without_addresses(ci);
#define INST_FN(name) i->name = (PFN_vk##name)gipa(*out, "vk" #name)
	INST_FN(DestroyInstance);
	INST_FN(GetPhysicalDeviceMemoryProperties);
	INST_FN(GetPhysicalDeviceMemoryProperties2);
	INST_FN(GetPhysicalDeviceMemoryProperties2KHR);
	INST_FN(GetPhysicalDeviceFeatures2);
	INST_FN(GetPhysicalDeviceFeatures2KHR);
#undef INST_FN
	inst_add(i);
	return VK_SUCCESS;
}

static VKAPI_ATTR void VKAPI_CALL destroy_instance(VkInstance inst,
						   const VkAllocationCallbacks *alloc)
{
	struct vinst *i = inst ? inst_of(inst) : NULL;
	if (!i)
		return;
	i->DestroyInstance(inst, alloc);
	inst_remove(i);
	free(i);
}

/* Under auto (VRAMLOCK_SWAP_UNREACHED=run: auto alone says it), or under an explicit
 * --release swap-vulkan? */
static int under_auto(void)
{
	const char *unreached = getenv("VRAMLOCK_SWAP_UNREACHED");
	return unreached && !strcmp(unreached, "run");
}

/* The driver cannot give a buffer made again the device address it had before (no
 * bufferDeviceAddressCaptureReplay is used yet), nor keep memory bound to a sparse
 * resource, and a device that enables addresses or sparse binding is left alone
 * (below). So that a program stays swappable, it is told the feature is
 * not there: under an explicit --release swap-vulkan, every program; under auto, only
 * one known to take its way without addresses (above). Any other program under auto
 * sees every feature the driver has: it runs as without the layer, and where it enables
 * addresses it runs unswapped. */
static void hide_unkeepable(VkPhysicalDevice phys, VkPhysicalDeviceFeatures2 *f)
{
	struct vinst *i = inst_of(phys);
	if (!engine.active || (under_auto() && !(i && i->without_addresses)))
		return;
	VkPhysicalDeviceFeatures *core = (VkPhysicalDeviceFeatures *)&f->features;
	core->sparseBinding = core->sparseResidencyBuffer = core->sparseResidencyImage2D = VK_FALSE;
	core->sparseResidencyImage3D = core->sparseResidencyAliased = VK_FALSE;
	core->sparseResidency2Samples = core->sparseResidency4Samples = VK_FALSE;
	core->sparseResidency8Samples = core->sparseResidency16Samples = VK_FALSE;
	for (VkBaseOutStructure *s = (VkBaseOutStructure *)f->pNext; s; s = s->pNext) {
		if (s->sType == VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_FEATURES) {
			VkPhysicalDeviceVulkan12Features *v = (void *)s;
			v->bufferDeviceAddress = v->bufferDeviceAddressCaptureReplay = VK_FALSE;
			v->bufferDeviceAddressMultiDevice = VK_FALSE;
		} else if (s->sType == VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_BUFFER_DEVICE_ADDRESS_FEATURES) {
			VkPhysicalDeviceBufferDeviceAddressFeatures *v = (void *)s;
			v->bufferDeviceAddress = v->bufferDeviceAddressCaptureReplay = VK_FALSE;
			v->bufferDeviceAddressMultiDevice = VK_FALSE;
		}
	}
}

static VKAPI_ATTR void VKAPI_CALL features2(VkPhysicalDevice phys, VkPhysicalDeviceFeatures2 *f)
{
	inst_of(phys)->GetPhysicalDeviceFeatures2(phys, f);
	hide_unkeepable(phys, f);
}

static VKAPI_ATTR void VKAPI_CALL features2_khr(VkPhysicalDevice phys,
						VkPhysicalDeviceFeatures2 *f)
{
	inst_of(phys)->GetPhysicalDeviceFeatures2KHR(phys, f);
	hide_unkeepable(phys, f);
}

/* ---- device ------------------------------------------------------------------ */

/* Device extensions whose entry points name no buffer or device memory, or only
 * through calls the layer translates. Any other enabled makes the device passive. */
static const char *const KNOWN[] = {
	"VK_KHR_16bit_storage", "VK_KHR_8bit_storage", "VK_KHR_shader_float16_int8",
	"VK_KHR_maintenance1", "VK_KHR_maintenance2", "VK_KHR_maintenance3",
	"VK_KHR_maintenance4", "VK_EXT_subgroup_size_control", "VK_KHR_cooperative_matrix",
	"VK_NV_cooperative_matrix2", "VK_KHR_shader_integer_dot_product",
	"VK_KHR_shader_bfloat16", "VK_EXT_shader_float8", "VK_KHR_pipeline_executable_properties",
	"VK_EXT_pipeline_robustness", "VK_EXT_memory_priority", "VK_EXT_external_memory_host",
	"VK_KHR_external_memory", "VK_EXT_shader_64bit_indexing",
	"VK_VALVE_shader_mixed_float_dot_product", "VK_KHR_shader_non_semantic_info",
	"VK_EXT_device_fault", "VK_KHR_storage_buffer_storage_class", "VK_KHR_variable_pointers",
	"VK_KHR_vulkan_memory_model", "VK_KHR_shader_subgroup_extended_types",
	"VK_KHR_dedicated_allocation", "VK_KHR_get_memory_requirements2", "VK_KHR_bind_memory2",
	"VK_KHR_timeline_semaphore", "VK_KHR_shader_float_controls", "VK_KHR_spirv_1_4",
	"VK_KHR_portability_subset", "VK_AMD_shader_core_properties",
	"VK_AMD_shader_core_properties2", "VK_NV_shader_sm_builtins",
	"VK_QCOM_cooperative_matrix_conversion", "VK_KHR_push_descriptor",
	"VK_KHR_shader_atomic_int64", "VK_EXT_shader_atomic_float", "VK_KHR_driver_properties",
	"VK_EXT_scalar_block_layout", "VK_KHR_uniform_buffer_standard_layout",
	"VK_EXT_descriptor_indexing", "VK_KHR_shader_draw_parameters", "VK_KHR_synchronization2",
	"VK_KHR_copy_commands2", "VK_KHR_descriptor_update_template",
	"VK_EXT_extended_dynamic_state",
};

static const char *unknown_extension(const VkDeviceCreateInfo *ci)
{
	for (uint32_t e = 0; e < ci->enabledExtensionCount; e++) {
		size_t k = 0;
		while (k < sizeof KNOWN / sizeof *KNOWN && strcmp(KNOWN[k], ci->ppEnabledExtensionNames[e]))
			k++;
		if (k == sizeof KNOWN / sizeof *KNOWN)
			return ci->ppEnabledExtensionNames[e];
	}
	return NULL;
}

/* Buffer device addresses enabled: through the 1.2 features, or their own structure
 * (core, KHR or EXT). */
static int addresses_enabled(const VkDeviceCreateInfo *ci)
{
	for (const VkBaseInStructure *s = ci->pNext; s; s = s->pNext)
		if ((s->sType == VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_FEATURES &&
		     ((const VkPhysicalDeviceVulkan12Features *)s)->bufferDeviceAddress) ||
		    (s->sType == VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_BUFFER_DEVICE_ADDRESS_FEATURES &&
		     ((const VkPhysicalDeviceBufferDeviceAddressFeatures *)s)->bufferDeviceAddress) ||
		    (s->sType == VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_BUFFER_DEVICE_ADDRESS_FEATURES_EXT &&
		     ((const VkPhysicalDeviceBufferDeviceAddressFeaturesEXT *)s)->bufferDeviceAddress))
			return 1;
	return 0;
}

static int sparse_enabled(const VkDeviceCreateInfo *ci)
{
	if (ci->pEnabledFeatures && ci->pEnabledFeatures->sparseBinding)
		return 1;
	for (const VkBaseInStructure *s = ci->pNext; s; s = s->pNext)
		if (s->sType == VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2 &&
		    ((const VkPhysicalDeviceFeatures2 *)s)->features.sparseBinding)
			return 1;
	return 0;
}

/* The loader's callback that makes a dispatchable object the layer creates its own. */
static PFN_vkSetDeviceLoaderData loader_data(const VkDeviceCreateInfo *ci)
{
	for (const VkLayerDeviceCreateInfo *s = ci->pNext; s; s = s->pNext)
		if (s->sType == VK_STRUCTURE_TYPE_LOADER_DEVICE_CREATE_INFO &&
		    s->function == VK_LOADER_DATA_CALLBACK)
			return s->u.pfnSetDeviceLoaderData;
	return NULL;
}

static void fill_device(struct vdev *d, VkDevice dev, PFN_vkGetDeviceProcAddr gdpa)
{
	d->dev = dev;
	d->gdpa = gdpa;
#define DEV_FN(name) d->name = (PFN_vk##name)gdpa(dev, "vk" #name);
#include "vkfuncs.h"
#undef DEV_FN
}

static VKAPI_ATTR VkResult VKAPI_CALL create_device(VkPhysicalDevice phys,
						    const VkDeviceCreateInfo *ci,
						    const VkAllocationCallbacks *alloc, VkDevice *out)
{
	VkLayerDeviceCreateInfo *link = (VkLayerDeviceCreateInfo *)ci->pNext;
	while (link && !(link->sType == VK_STRUCTURE_TYPE_LOADER_DEVICE_CREATE_INFO &&
			 link->function == VK_LAYER_LINK_INFO))
		link = (VkLayerDeviceCreateInfo *)link->pNext;
	struct vinst *i = inst_of(phys);
	if (!link || !i)
		return VK_ERROR_INITIALIZATION_FAILED;
	PFN_vkGetInstanceProcAddr gipa = link->u.pLayerInfo->pfnNextGetInstanceProcAddr;
	PFN_vkGetDeviceProcAddr gdpa = link->u.pLayerInfo->pfnNextGetDeviceProcAddr;
	link->u.pLayerInfo = link->u.pLayerInfo->pNext;
	PFN_vkSetDeviceLoaderData set_data = loader_data(ci);
	if (engine.active)
		control_join(); /* no device is made before vramlock run said where we stand */
	PFN_vkCreateDevice create = (PFN_vkCreateDevice)gipa(i->inst, "vkCreateDevice");
	VkResult r = create(phys, ci, alloc, out);
	if (r != VK_SUCCESS)
		return r;
	struct vdev *d = calloc(1, sizeof *d);
	if (!d)
		return VK_ERROR_OUT_OF_HOST_MEMORY;
	fill_device(d, *out, gdpa);
	d->phys = phys;
	d->set_loader_data = set_data;
	d->family = ci->queueCreateInfoCount ? ci->pQueueCreateInfos[0].queueFamilyIndex : 0;
	i->GetPhysicalDeviceMemoryProperties(phys, &d->props);
	memtypes_build(&d->props, &d->shown);
	const char *ext = unknown_extension(ci);
	if (ext)
		snprintf(d->why, sizeof d->why, "the program enables %s, which the layer does not"
			 " translate", ext);
	else if (sparse_enabled(ci))
		snprintf(d->why, sizeof d->why, "the program enables sparse binding");
	else if (addresses_enabled(ci))
		snprintf(d->why, sizeof d->why, "the program uses buffer device addresses (it"
			 " enables bufferDeviceAddress), which the layer cannot keep yet");
	d->passive = d->why[0] != 0;
	if (engine.active && d->passive)
		TRACE("device %p left alone: %s", (void *)*out, d->why);
	dev_add(d);
	if (engine.active && !d->passive)
		ahead_start(); /* host copies made ahead from now on (ahead.c) */
	return VK_SUCCESS;
}

static VKAPI_ATTR void VKAPI_CALL destroy_device(VkDevice dev, const VkAllocationCallbacks *alloc)
{
	struct vdev *d = dev ? dev_of(dev) : NULL;
	if (!d)
		return;
	pthread_mutex_lock(&mu);
	ahead_wait(d); /* no host copy is being made on it */
	/* Kept in the list (a release walks it without the list's lock): marked gone, before
	 * it goes, so that no host copy is made on it again (ahead.c). */
	d->passive = 1;
	snprintf(d->why, sizeof d->why, "destroyed");
	table_device_gone(d);
	stage_free(d);
	pthread_mutex_unlock(&mu);
	d->DestroyDevice(dev, alloc);
}

/* ---- entry points ------------------------------------------------------------ */

/* Ours for `name`, or NULL. */
static PFN_vkVoidFunction ours(const char *name)
{
	PFN_vkVoidFunction fn = NULL;
	if (!strcmp(name, "vkCreateDevice"))
		return (PFN_vkVoidFunction)create_device;
	if (!strcmp(name, "vkDestroyDevice"))
		return (PFN_vkVoidFunction)destroy_device;
	table_hook(name, &fn);
	memtypes_hook(name, &fn);
	sets_hook(name, &fn);
	record_hook(name, &fn);
	cmds2_hook(name, &fn);
	engine_hook(name, &fn);
	writes_hook(name, &fn);
	return fn;
}

/* Static, and handed out by address: the exported names below would resolve to the
 * loader's own (libvulkan, loaded first, exports the same names). */
static VKAPI_ATTR PFN_vkVoidFunction VKAPI_CALL device_proc(VkDevice dev, const char *name);

static VKAPI_ATTR PFN_vkVoidFunction VKAPI_CALL instance_proc(VkInstance inst, const char *name)
{
	if (!strcmp(name, "vkGetInstanceProcAddr"))
		return (PFN_vkVoidFunction)instance_proc;
	if (!strcmp(name, "vkGetDeviceProcAddr"))
		return (PFN_vkVoidFunction)device_proc;
	if (!strcmp(name, "vkCreateInstance"))
		return (PFN_vkVoidFunction)create_instance;
	if (!strcmp(name, "vkDestroyInstance"))
		return (PFN_vkVoidFunction)destroy_instance;
	if (!strcmp(name, "vkGetPhysicalDeviceFeatures2"))
		return (PFN_vkVoidFunction)features2;
	if (!strcmp(name, "vkGetPhysicalDeviceFeatures2KHR"))
		return (PFN_vkVoidFunction)features2_khr;
	PFN_vkVoidFunction fn = NULL;
	memtypes_instance_hook(name, &fn);
	if (fn)
		return fn;
	fn = ours(name);
	if (fn)
		return fn;
	struct vinst *i = inst ? inst_of(inst) : NULL;
	return i ? i->gipa(inst, name) : NULL;
}

static VKAPI_ATTR PFN_vkVoidFunction VKAPI_CALL device_proc(VkDevice dev, const char *name)
{
	struct vdev *d = dev_of(dev);
	if (!d)
		return NULL;
	/* A device left alone still has its memory types translated: the program saw them
	 * before its device was made. */
	int wrapped = is_ours(d) || !strcmp(name, "vkDestroyDevice") ||
		      (engine.active && memtypes_named(name));
	PFN_vkVoidFunction next = d->gdpa(dev, name);
	PFN_vkVoidFunction fn = wrapped && next ? ours(name) : NULL;
	return fn ? fn : next;
}

EXPORT VKAPI_ATTR PFN_vkVoidFunction VKAPI_CALL vkGetInstanceProcAddr(VkInstance inst,
								       const char *name)
{
	return instance_proc(inst, name);
}

EXPORT VKAPI_ATTR PFN_vkVoidFunction VKAPI_CALL vkGetDeviceProcAddr(VkDevice dev, const char *name)
{
	return device_proc(dev, name);
}

EXPORT VKAPI_ATTR VkResult VKAPI_CALL
vkNegotiateLoaderLayerInterfaceVersion(VkNegotiateLayerInterface *v)
{
	if (v->loaderLayerInterfaceVersion > 2)
		v->loaderLayerInterfaceVersion = 2;
	v->pfnGetInstanceProcAddr = instance_proc;
	v->pfnGetDeviceProcAddr = device_proc;
	v->pfnGetPhysicalDeviceProcAddr = NULL;
	return VK_SUCCESS;
}
