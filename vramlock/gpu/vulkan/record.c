/*
 * record.c: calls that name a buffer, translated to the driver's buffer of the
 * moment. Descriptor writes that name one are kept, per set, and written again after
 * a restore (a program such as llama.cpp writes a set once and binds it for ever).
 * Command buffers are followed through their states: one recorded over the program's
 * buffers and not reset names buffers a release destroys, so no release is made
 * while one exists (record_busy). Descriptor update templates are followed too: an
 * update through one is translated and kept as a write is.
 */
#include "vklayer.h"

/* ---- descriptor sets --------------------------------------------------------- */

struct entry {
	uint32_t binding, element;
	VkDescriptorType type;
	struct vbuf *buf;
	VkDeviceSize offset, range;
};

/* A layout's bindings and their descriptor counts, in binding order. */
struct counts {
	uint32_t binding, count;
};

struct dset {
	VkDescriptorSet set;
	VkDescriptorPool pool;
	struct vdev *d;
	struct entry *e;
	uint32_t n, cap;
	struct counts *layout; /* its layout's, copied; NULL: not known */
	uint32_t nlayout;
	struct dset *next;
};

#define BUCKETS 4096
static struct dset *sets[BUCKETS];

static size_t slot(uint64_t h)
{
	return (size_t)((h * 0x9E3779B97F4A7C15ull) >> 52);
}

/* With `mu`: the set's record, made where `make`. */
static struct dset *set_of(VkDescriptorSet set, int make)
{
	struct dset **head = &sets[slot((uint64_t)(uintptr_t)set)];
	for (struct dset *s = *head; s; s = s->next)
		if (s->set == set)
			return s;
	if (!make)
		return NULL;
	struct dset *s = calloc(1, sizeof *s);
	if (s) {
		s->set = set;
		s->next = *head;
		*head = s;
	}
	return s;
}

static void drop_set(struct dset *gone)
{
	struct dset **head = &sets[slot((uint64_t)(uintptr_t)gone->set)];
	for (struct dset **p = head; *p; p = &(*p)->next)
		if (*p == gone) {
			*p = gone->next;
			break;
		}
	free(gone->e);
	free(gone->layout);
	free(gone);
}

/* ---- layouts: a write of several descriptors runs on into the next bindings once
 * one is full (llama.cpp writes all of a set's in one): each descriptor's binding is
 * found from the set's layout. ------------------------------------------------------ */

struct layout {
	VkDescriptorSetLayout handle;
	struct counts *c;
	uint32_t n;
	struct layout *next;
};

static struct layout *layouts;

static VKAPI_ATTR VkResult VKAPI_CALL create_layout(VkDevice dev,
						    const VkDescriptorSetLayoutCreateInfo *ci,
						    const VkAllocationCallbacks *alloc,
						    VkDescriptorSetLayout *out)
{
	struct vdev *d = dev_of(dev);
	VkResult r = d->CreateDescriptorSetLayout(dev, ci, alloc, out);
	if (r != VK_SUCCESS || !is_ours(d))
		return r;
	struct layout *l = calloc(1, sizeof *l);
	if (l && ci->bindingCount && !(l->c = malloc(sizeof *l->c * ci->bindingCount)))
		free(l), l = NULL;
	for (uint32_t k = 0; l && k < ci->bindingCount; k++) { /* sorted as they come */
		struct counts c = {ci->pBindings[k].binding, ci->pBindings[k].descriptorCount};
		uint32_t at = l->n++;
		for (; at > 0 && l->c[at - 1].binding > c.binding; at--)
			l->c[at] = l->c[at - 1];
		l->c[at] = c;
	}
	pthread_mutex_lock(&mu);
	if (l)
		l->handle = *out, l->next = layouts, layouts = l;
	pthread_mutex_unlock(&mu);
	return r;
}

static VKAPI_ATTR void VKAPI_CALL destroy_layout(VkDevice dev, VkDescriptorSetLayout layout,
						 const VkAllocationCallbacks *alloc)
{
	struct vdev *d = dev_of(dev);
	pthread_mutex_lock(&mu);
	for (struct layout **p = &layouts; is_ours(d) && layout && *p; p = &(*p)->next)
		if ((*p)->handle == layout) {
			struct layout *gone = *p;
			*p = gone->next;
			free(gone->c), free(gone);
			break;
		}
	pthread_mutex_unlock(&mu);
	d->DestroyDescriptorSetLayout(dev, layout, alloc);
}

/* With `mu`: the set takes a copy of its layout's counts. */
static void laid_out(struct dset *s, VkDescriptorSetLayout layout)
{
	free(s->layout);
	s->layout = NULL, s->nlayout = 0;
	struct layout *l = layouts;
	while (l && l->handle != layout)
		l = l->next;
	if (l && l->n && (s->layout = malloc(sizeof *l->c * l->n))) {
		memcpy(s->layout, l->c, sizeof *l->c * l->n);
		s->nlayout = l->n;
	}
}

/* The descriptor at (`*binding`, `*element`) of a write, run on to the next binding
 * where this one is full. */
static void run_on(const struct dset *s, uint32_t *binding, uint32_t *element)
{
	uint32_t k = 0;
	while (s && k < s->nlayout && s->layout[k].binding < *binding)
		k++;
	if (!s || k == s->nlayout || s->layout[k].binding != *binding)
		return; /* not known: as it says */
	while (*element >= s->layout[k].count && k + 1 < s->nlayout)
		k++, *element = 0;
	*binding = s->layout[k].binding;
}

static int is_buffer_type(VkDescriptorType t)
{
	return t == VK_DESCRIPTOR_TYPE_UNIFORM_BUFFER || t == VK_DESCRIPTOR_TYPE_STORAGE_BUFFER ||
	       t == VK_DESCRIPTOR_TYPE_UNIFORM_BUFFER_DYNAMIC ||
	       t == VK_DESCRIPTOR_TYPE_STORAGE_BUFFER_DYNAMIC;
}

/* With `mu`: the set's descriptor (binding, element) names `e` now (its buffer NULL:
 * nothing of ours). */
static void remember(struct dset *s, const struct entry *e)
{
	for (uint32_t k = 0; k < s->n; k++)
		if (s->e[k].binding == e->binding && s->e[k].element == e->element) {
			s->e[k] = *e;
			return;
		}
	if (!e->buf)
		return;
	if (s->n == s->cap) {
		uint32_t cap = s->cap ? 2 * s->cap : 8;
		struct entry *grown = realloc(s->e, sizeof *grown * cap);
		if (!grown) {
			refuse("out of host memory for its descriptor writes");
			return;
		}
		s->e = grown, s->cap = cap;
	}
	s->e[s->n++] = *e;
}

/* Each buffer write of `w`, the driver's buffers in `infos` (w's count long). */
static void translate_write(struct dset *s, const VkWriteDescriptorSet *w,
			    VkDescriptorBufferInfo *infos)
{
	uint32_t binding = w->dstBinding, element = w->dstArrayElement;
	for (uint32_t k = 0; k < w->descriptorCount; k++, element++) {
		const VkDescriptorBufferInfo *in = &w->pBufferInfo[k];
		run_on(s, &binding, &element);
		struct entry e = {binding, element, w->descriptorType, (struct vbuf *)in->buffer,
				  in->offset, in->range};
		infos[k] = *in;
		infos[k].buffer = real_buf(in->buffer);
		if (s)
			remember(s, &e);
	}
}

static void copy_entries(const VkCopyDescriptorSet *c)
{
	struct dset *from = set_of(c->srcSet, 0), *to = set_of(c->dstSet, 1);
	for (uint32_t k = 0; to && k < c->descriptorCount; k++) {
		struct entry e = {c->dstBinding, c->dstArrayElement + k, 0, NULL, 0, 0};
		for (uint32_t i = 0; from && i < from->n; i++)
			if (from->e[i].binding == c->srcBinding &&
			    from->e[i].element == c->srcArrayElement + k)
				e.type = from->e[i].type, e.buf = from->e[i].buf,
				e.offset = from->e[i].offset, e.range = from->e[i].range;
		remember(to, &e);
	}
}

static VKAPI_ATTR void VKAPI_CALL update_sets(VkDevice dev, uint32_t nw,
					      const VkWriteDescriptorSet *w, uint32_t nc,
					      const VkCopyDescriptorSet *c)
{
	struct vdev *d = dev_of(dev);
	if (!is_ours(d)) {
		d->UpdateDescriptorSets(dev, nw, w, nc, c);
		return;
	}
	size_t total = 0;
	for (uint32_t k = 0; k < nw; k++)
		if (is_buffer_type(w[k].descriptorType))
			total += w[k].descriptorCount;
	/* A program may update at every dispatch (llama.cpp does): a few writes, on the
	 * stack. */
	VkWriteDescriptorSet few_writes[16];
	VkDescriptorBufferInfo few_infos[64];
	VkWriteDescriptorSet *writes = nw <= 16 ? few_writes : malloc(sizeof *writes * nw);
	VkDescriptorBufferInfo *infos = total <= 64 ? few_infos : malloc(sizeof *infos * total);
	if (!writes || !infos) {
		if (writes != few_writes)
			free(writes);
		if (infos != few_infos)
			free(infos);
		refuse("out of host memory for its descriptor writes");
		return;
	}
	gate_enter();
	pthread_mutex_lock(&mu);
	size_t at = 0;
	for (uint32_t k = 0; k < nw; k++) {
		writes[k] = w[k];
		if (!is_buffer_type(w[k].descriptorType))
			continue;
		struct dset *s = set_of(w[k].dstSet, 1);
		if (s)
			s->d = d;
		translate_write(s, &w[k], infos + at);
		writes[k].pBufferInfo = infos + at;
		at += w[k].descriptorCount;
	}
	for (uint32_t k = 0; k < nc; k++)
		copy_entries(&c[k]);
	d->UpdateDescriptorSets(dev, nw, writes, nc, c);
	pthread_mutex_unlock(&mu);
	gate_leave();
	if (writes != few_writes)
		free(writes);
	if (infos != few_infos)
		free(infos);
}

static VKAPI_ATTR VkResult VKAPI_CALL allocate_sets(VkDevice dev,
						    const VkDescriptorSetAllocateInfo *info,
						    VkDescriptorSet *out)
{
	struct vdev *d = dev_of(dev);
	VkResult r = d->AllocateDescriptorSets(dev, info, out);
	if (r != VK_SUCCESS || !is_ours(d))
		return r;
	pthread_mutex_lock(&mu);
	for (uint32_t k = 0; k < info->descriptorSetCount; k++) {
		struct dset *s = set_of(out[k], 1);
		if (s) {
			s->pool = info->descriptorPool, s->d = d;
			s->n = 0; /* a handle used before, freed with its pool */
			laid_out(s, info->pSetLayouts[k]);
		}
	}
	pthread_mutex_unlock(&mu);
	return r;
}

static VKAPI_ATTR VkResult VKAPI_CALL free_sets(VkDevice dev, VkDescriptorPool pool, uint32_t n,
						const VkDescriptorSet *set)
{
	struct vdev *d = dev_of(dev);
	pthread_mutex_lock(&mu);
	for (uint32_t k = 0; is_ours(d) && k < n; k++) {
		struct dset *s = set ? set_of(set[k], 0) : NULL;
		if (s)
			drop_set(s);
	}
	pthread_mutex_unlock(&mu);
	return d->FreeDescriptorSets(dev, pool, n, set);
}

static void drop_pool(VkDescriptorPool pool)
{
	pthread_mutex_lock(&mu);
	for (size_t b = 0; b < BUCKETS; b++)
		for (struct dset *s = sets[b], *next; s; s = next) {
			next = s->next;
			if (s->pool == pool)
				drop_set(s);
		}
	pthread_mutex_unlock(&mu);
}

static VKAPI_ATTR VkResult VKAPI_CALL reset_pool(VkDevice dev, VkDescriptorPool pool,
						 VkDescriptorPoolResetFlags flags)
{
	struct vdev *d = dev_of(dev);
	if (is_ours(d))
		drop_pool(pool);
	return d->ResetDescriptorPool(dev, pool, flags);
}

static VKAPI_ATTR void VKAPI_CALL destroy_set_pool(VkDevice dev, VkDescriptorPool pool,
						   const VkAllocationCallbacks *alloc)
{
	struct vdev *d = dev_of(dev);
	if (is_ours(d) && pool)
		drop_pool(pool);
	d->DestroyDescriptorPool(dev, pool, alloc);
}

/* With `mu`, after a restore: each kept write written again with the buffer of now. */
void record_rewrite(void)
{
	for (size_t b = 0; b < BUCKETS; b++)
		for (struct dset *s = sets[b]; s; s = s->next)
			for (uint32_t k = 0; k < s->n; k++) {
				struct entry *e = &s->e[k];
				if (!e->buf || !s->d || s->d->passive)
					continue;
				VkDescriptorBufferInfo info = {e->buf->real, e->offset, e->range};
				VkWriteDescriptorSet w = {
					.sType = VK_STRUCTURE_TYPE_WRITE_DESCRIPTOR_SET,
					.dstSet = s->set, .dstBinding = e->binding,
					.dstArrayElement = e->element, .descriptorCount = 1,
					.descriptorType = e->type, .pBufferInfo = &info};
				s->d->UpdateDescriptorSets(s->d->dev, 1, &w, 0, NULL);
			}
}

/* With `mu`, at a submit (writes.c): the memory under each storage buffer that the
 * set names at `binding` (UINT32_MAX: at any) counts as written. */
void record_mark_written(VkDescriptorSet set, uint32_t binding)
{
	struct dset *s = set_of(set, 0);
	for (uint32_t k = 0; s && k < s->n; k++) {
		struct entry *e = &s->e[k];
		if ((binding == UINT32_MAX || e->binding == binding) && e->buf && e->buf->mem &&
		    (e->type == VK_DESCRIPTOR_TYPE_STORAGE_BUFFER ||
		     e->type == VK_DESCRIPTOR_TYPE_STORAGE_BUFFER_DYNAMIC))
			e->buf->mem->written = 1;
	}
}

/* A buffer destroyed: the writes that named it name nothing of ours any more. */
void record_forget_buffer(struct vbuf *gone)
{
	pthread_mutex_lock(&mu);
	for (size_t b = 0; b < BUCKETS; b++)
		for (struct dset *s = sets[b]; s; s = s->next)
			for (uint32_t k = 0; k < s->n; k++)
				if (s->e[k].buf == gone)
					s->e[k].buf = NULL;
	pthread_mutex_unlock(&mu);
}

/* ---- descriptor update templates: each template's entries kept at its creation; an
 * update through one is translated in a copy of its raw data, and its buffers kept as
 * vkUpdateDescriptorSets' are (written again after a restore). --------------------- */

struct tmpl {
	VkDescriptorUpdateTemplate handle;
	VkDescriptorUpdateTemplateEntry *e;
	uint32_t n;
	size_t size; /* how far its entries reach into the raw data */
	struct tmpl *next;
};

static struct tmpl *templates;

void record_forget(void)
{
	memset(sets, 0, sizeof sets);
	layouts = NULL;
	templates = NULL;
}

/* The bytes of one descriptor of type `t` in a template's raw data. */
static size_t element_size(VkDescriptorType t)
{
	if (is_buffer_type(t))
		return sizeof(VkDescriptorBufferInfo);
	if (t == VK_DESCRIPTOR_TYPE_UNIFORM_TEXEL_BUFFER ||
	    t == VK_DESCRIPTOR_TYPE_STORAGE_TEXEL_BUFFER)
		return sizeof(VkBufferView);
	if (t == VK_DESCRIPTOR_TYPE_SAMPLER || t == VK_DESCRIPTOR_TYPE_COMBINED_IMAGE_SAMPLER ||
	    t == VK_DESCRIPTOR_TYPE_SAMPLED_IMAGE || t == VK_DESCRIPTOR_TYPE_STORAGE_IMAGE ||
	    t == VK_DESCRIPTOR_TYPE_INPUT_ATTACHMENT)
		return sizeof(VkDescriptorImageInfo);
	return sizeof(uint64_t); /* a handle (an acceleration structure) */
}

/* Where the entry's descriptors end in the raw data. */
static size_t entry_end(const VkDescriptorUpdateTemplateEntry *e)
{
	if (e->descriptorType == VK_DESCRIPTOR_TYPE_INLINE_UNIFORM_BLOCK)
		return e->offset + e->descriptorCount; /* its count is in bytes */
	if (!e->descriptorCount)
		return e->offset;
	return e->offset + (size_t)(e->descriptorCount - 1) * e->stride +
	       element_size(e->descriptorType);
}

static VkResult create_template(PFN_vkCreateDescriptorUpdateTemplate fn, VkDevice dev,
				const VkDescriptorUpdateTemplateCreateInfo *ci,
				const VkAllocationCallbacks *alloc, VkDescriptorUpdateTemplate *out)
{
	struct vdev *d = dev_of(dev);
	VkResult r = fn(dev, ci, alloc, out);
	if (r != VK_SUCCESS || !is_ours(d))
		return r;
	struct tmpl *t = calloc(1, sizeof *t);
	uint32_t n = ci->descriptorUpdateEntryCount;
	if (t && n && !(t->e = malloc(sizeof *t->e * n)))
		free(t), t = NULL;
	if (!t) {
		refuse("out of host memory for a descriptor update template");
		return r;
	}
	for (uint32_t k = 0; k < n; k++) {
		t->e[k] = ci->pDescriptorUpdateEntries[k];
		size_t end = entry_end(&t->e[k]);
		t->size = end > t->size ? end : t->size;
	}
	t->n = n, t->handle = *out;
	pthread_mutex_lock(&mu);
	t->next = templates, templates = t;
	pthread_mutex_unlock(&mu);
	return r;
}

static VKAPI_ATTR VkResult VKAPI_CALL create_template_core(
	VkDevice dev, const VkDescriptorUpdateTemplateCreateInfo *ci,
	const VkAllocationCallbacks *alloc, VkDescriptorUpdateTemplate *out)
{
	return create_template(dev_of(dev)->CreateDescriptorUpdateTemplate, dev, ci, alloc, out);
}

static VKAPI_ATTR VkResult VKAPI_CALL create_template_khr(
	VkDevice dev, const VkDescriptorUpdateTemplateCreateInfo *ci,
	const VkAllocationCallbacks *alloc, VkDescriptorUpdateTemplate *out)
{
	return create_template(dev_of(dev)->CreateDescriptorUpdateTemplateKHR, dev, ci, alloc, out);
}

static void destroy_template(PFN_vkDestroyDescriptorUpdateTemplate fn, VkDevice dev,
			     VkDescriptorUpdateTemplate handle, const VkAllocationCallbacks *alloc)
{
	pthread_mutex_lock(&mu);
	for (struct tmpl **p = &templates; handle && *p; p = &(*p)->next)
		if ((*p)->handle == handle) {
			struct tmpl *gone = *p;
			*p = gone->next;
			free(gone->e), free(gone);
			break;
		}
	pthread_mutex_unlock(&mu);
	fn(dev, handle, alloc);
}

static VKAPI_ATTR void VKAPI_CALL destroy_template_core(VkDevice dev,
							VkDescriptorUpdateTemplate t,
							const VkAllocationCallbacks *alloc)
{
	destroy_template(dev_of(dev)->DestroyDescriptorUpdateTemplate, dev, t, alloc);
}

static VKAPI_ATTR void VKAPI_CALL destroy_template_khr(VkDevice dev,
						       VkDescriptorUpdateTemplate t,
						       const VkAllocationCallbacks *alloc)
{
	destroy_template(dev_of(dev)->DestroyDescriptorUpdateTemplateKHR, dev, t, alloc);
}

/* With `mu`: the buffer entries of `t` in `copy` (the raw data's copy) translated, each
 * kept in `s` (where a set is written), `written` told each storage buffer `cw`'s writes
 * (where pushed). */
static void translate_template(const struct tmpl *t, char *copy, struct dset *s,
			       struct cbw *cw, void (*written)(struct cbw *, VkBuffer))
{
	for (uint32_t k = 0; k < t->n; k++) {
		const VkDescriptorUpdateTemplateEntry *te = &t->e[k];
		if (!is_buffer_type(te->descriptorType))
			continue;
		uint32_t binding = te->dstBinding, element = te->dstArrayElement;
		for (uint32_t i = 0; i < te->descriptorCount; i++, element++) {
			VkDescriptorBufferInfo in;
			char *at = copy + te->offset + (size_t)i * te->stride;
			memcpy(&in, at, sizeof in); /* the raw data need not be aligned */
			run_on(s, &binding, &element);
			struct entry e = {binding, element, te->descriptorType,
					  (struct vbuf *)in.buffer, in.offset, in.range};
			if (s)
				remember(s, &e);
			if (written && te->descriptorType == VK_DESCRIPTOR_TYPE_STORAGE_BUFFER)
				written(cw, in.buffer);
			in.buffer = real_buf(in.buffer);
			memcpy(at, &in, sizeof in);
		}
	}
}

/* With `mu`: the raw data for `handle` translated into a copy, or NULL (refused). */
static void *template_copy(VkDescriptorUpdateTemplate handle, const void *data, struct dset *s,
			   struct cbw *cw, void (*written)(struct cbw *, VkBuffer))
{
	struct tmpl *t = templates;
	while (t && t->handle != handle)
		t = t->next;
	char *copy = t ? malloc(t->size ? t->size : 1) : NULL;
	if (!copy) {
		if (!engine.refused[0]) /* refuse() takes `mu`: said here */
			snprintf(engine.refused, sizeof engine.refused, "%s",
				 t ? "out of host memory for its descriptor writes"
				   : "a descriptor update template the layer did not see made");
		return NULL;
	}
	memcpy(copy, data, t->size);
	translate_template(t, copy, s, cw, written);
	return copy;
}

void *template_data(VkDescriptorUpdateTemplate t, const void *data, struct cbw *cw,
		    void (*written)(struct cbw *, VkBuffer))
{
	return template_copy(t, data, NULL, cw, written);
}

static void update_template(PFN_vkUpdateDescriptorSetWithTemplate fn, VkDevice dev,
			    VkDescriptorSet set, VkDescriptorUpdateTemplate t, const void *data)
{
	struct vdev *d = dev_of(dev);
	if (!is_ours(d)) {
		fn(dev, set, t, data);
		return;
	}
	gate_enter();
	pthread_mutex_lock(&mu);
	struct dset *s = set_of(set, 1);
	if (s)
		s->d = d;
	void *copy = template_copy(t, data, s, NULL, NULL);
	if (copy)
		fn(dev, set, t, copy);
	pthread_mutex_unlock(&mu);
	gate_leave();
	free(copy);
}

static VKAPI_ATTR void VKAPI_CALL update_template_core(VkDevice dev, VkDescriptorSet set,
						       VkDescriptorUpdateTemplate t,
						       const void *data)
{
	update_template(dev_of(dev)->UpdateDescriptorSetWithTemplate, dev, set, t, data);
}

static VKAPI_ATTR void VKAPI_CALL update_template_khr(VkDevice dev, VkDescriptorSet set,
						      VkDescriptorUpdateTemplate t,
						      const void *data)
{
	update_template(dev_of(dev)->UpdateDescriptorSetWithTemplateKHR, dev, set, t, data);
}

void sets_hook(const char *name, PFN_vkVoidFunction *fn)
{
	static const struct hook hooks[] = {
		HOOK(UpdateDescriptorSets, update_sets),
		HOOK(AllocateDescriptorSets, allocate_sets),
		HOOK(FreeDescriptorSets, free_sets),
		HOOK(ResetDescriptorPool, reset_pool),
		HOOK(DestroyDescriptorPool, destroy_set_pool),
		HOOK(CreateDescriptorSetLayout, create_layout),
		HOOK(DestroyDescriptorSetLayout, destroy_layout),
		HOOK(CreateDescriptorUpdateTemplate, create_template_core),
		HOOK(CreateDescriptorUpdateTemplateKHR, create_template_khr),
		HOOK(DestroyDescriptorUpdateTemplate, destroy_template_core),
		HOOK(DestroyDescriptorUpdateTemplateKHR, destroy_template_khr),
		HOOK(UpdateDescriptorSetWithTemplate, update_template_core),
		HOOK(UpdateDescriptorSetWithTemplateKHR, update_template_khr),
	};
	hook_lookup(hooks, sizeof hooks / sizeof *hooks, name, fn);
}
