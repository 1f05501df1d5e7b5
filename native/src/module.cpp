// sfstore._native: the Python boundary. Thin by design: parse and validate arguments, hold Python
// buffers alive while the engine uses them, release the GIL around waiting, and raise typed errors.
#include <fcntl.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/vector.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <new>
#include <system_error>
#include <unordered_map>

#include "beneath.hpp"
#include "buffer_pool.hpp"
#include "checksum.hpp"
#include "common.hpp"
#include "cuda_host.hpp"
#include "dlpack.hpp"
#include "io_engine.hpp"
#include "layer_copy.hpp"
#include "pyerrors.hpp"

namespace nb = nanobind;
using namespace nb::literals;
using namespace sfstore;

namespace {

// ---------------------------------------------------------------------------------------------------
// Registered buffers

struct PyPool {
    std::shared_ptr<BufferPool> pool;
};

// A buffer handed out by a pool (root) or a slice of one (view). `exports` counts live buffer-protocol
// views, DLPack capsules and slices; a root goes back to its pool only when there are none.
struct PyBuffer {
    std::shared_ptr<BufferPool> pool;  // roots only
    Region region{};                   // roots only
    char* ptr = nullptr;
    size_t size = 0;
    PyObject* parent = nullptr;  // views: strong reference to the parent Buffer object
    PyBuffer* parent_c = nullptr;
    long exports = 0;  // guarded by the GIL
    bool released = true;
    bool locked = false, huge = false, cuda = false;

    PyBuffer() = default;
    PyBuffer(const PyBuffer&) = delete;
    PyBuffer(PyBuffer&& o) noexcept { *this = std::move(o); }
    PyBuffer& operator=(PyBuffer&& o) noexcept {
        pool = std::move(o.pool);
        region = o.region;
        ptr = o.ptr;
        size = o.size;
        parent = o.parent;
        parent_c = o.parent_c;
        exports = o.exports;
        released = o.released;
        locked = o.locked;
        huge = o.huge;
        cuda = o.cuda;
        o.parent = nullptr;
        o.parent_c = nullptr;
        o.released = true;
        o.ptr = nullptr;
        return *this;
    }
    ~PyBuffer() { detach(); }

    void check_live() const {
        if (released) raise_sf("invalid", EINVAL, "operation on a released buffer");
    }
    // Gives the memory back (root) or lets go of the parent (view). The caller checked `exports`.
    void detach() {
        if (released) return;
        released = true;
        if (parent) {
            parent_c->exports--;
            PyObject* p = parent;
            parent = nullptr;
            Py_DECREF(p);
        } else if (pool) {
            pool->release(region);
        }
    }
};

int buffer_getbuffer(PyObject* self, Py_buffer* view, int flags) {
    PyBuffer* b = nb::inst_ptr<PyBuffer>(self);
    if (b->released) {
        PyErr_SetString(PyExc_ValueError, "operation on a released buffer");
        view->obj = nullptr;
        return -1;
    }
    if (PyBuffer_FillInfo(view, self, b->ptr, static_cast<Py_ssize_t>(b->size), 0, flags) < 0) return -1;
    b->exports++;
    return 0;
}

void buffer_releasebuffer(PyObject* self, Py_buffer*) { nb::inst_ptr<PyBuffer>(self)->exports--; }

PyType_Slot buffer_slots[] = {{Py_bf_getbuffer, reinterpret_cast<void*>(buffer_getbuffer)},
                              {Py_bf_releasebuffer, reinterpret_cast<void*>(buffer_releasebuffer)},
                              {0, nullptr}};

struct DlContext {
    PyObject* owner;
    PyBuffer* buf;
    int64_t shape[1];
    int64_t strides[1];
};

void dl_release(DlContext* ctx) {
    // Consumers may free the tensor on any thread.
    PyGILState_STATE st = ensure_gil();  // parks this thread if the interpreter is finalizing
    ctx->buf->exports--;
    Py_DECREF(ctx->owner);
    PyGILState_Release(st);
    delete ctx;
}

void dl_delete_legacy(DLManagedTensor* t) {
    dl_release(static_cast<DlContext*>(t->manager_ctx));
    delete t;
}

void dl_delete_versioned(DLManagedTensorVersioned* t) {
    dl_release(static_cast<DlContext*>(t->manager_ctx));
    delete t;
}

void capsule_legacy(PyObject* cap) {
    if (!PyCapsule_IsValid(cap, "dltensor")) return;  // consumed ("used_dltensor"): the consumer owns it
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(cap, "dltensor"));
    if (m && m->deleter) m->deleter(m);
    PyErr_Restore(t, v, tb);
}

void capsule_versioned(PyObject* cap) {
    if (!PyCapsule_IsValid(cap, "dltensor_versioned")) return;
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    auto* m = static_cast<DLManagedTensorVersioned*>(PyCapsule_GetPointer(cap, "dltensor_versioned"));
    if (m && m->deleter) m->deleter(m);
    PyErr_Restore(t, v, tb);
}

DLTensor make_dltensor(PyBuffer* b, DlContext* ctx) {
    ctx->shape[0] = static_cast<int64_t>(b->size);
    ctx->strides[0] = 1;
    DLTensor t{};
    t.data = b->ptr;
    t.device = DLDevice{kDLCPU, 0};
    t.ndim = 1;
    t.dtype = DLDataType{kDLUInt, 8, 1};
    t.shape = ctx->shape;
    t.strides = ctx->strides;
    t.byte_offset = 0;
    return t;
}

nb::object buffer_dlpack(nb::handle self, nb::object stream, nb::object max_version, nb::object dl_device,
                         nb::object copy) {
    PyBuffer* b = nb::inst_ptr<PyBuffer>(self);
    b->check_live();
    if (!copy.is_none() && nb::cast<bool>(copy))
        throw nb::buffer_error("sfstore buffers export their memory, never a copy (copy=True refused)");
    if (!dl_device.is_none()) {
        auto dev = nb::cast<std::pair<int, int>>(dl_device);
        if (dev.first != kDLCPU) throw nb::buffer_error("sfstore buffers live in host memory (device kDLCPU)");
    }
    bool versioned = false;
    if (!max_version.is_none()) versioned = nb::cast<std::pair<int, int>>(max_version).first >= 1;
    auto* ctx = new DlContext{self.ptr(), b, {0}, {1}};
    Py_INCREF(self.ptr());
    b->exports++;
    PyObject* cap;
    if (versioned) {
        auto* m = new DLManagedTensorVersioned{};
        m->version = DLPackVersion{1, 0};
        m->manager_ctx = ctx;
        m->deleter = dl_delete_versioned;
        m->flags = 0;
        m->dl_tensor = make_dltensor(b, ctx);
        cap = PyCapsule_New(m, "dltensor_versioned", capsule_versioned);
        if (!cap) dl_delete_versioned(m);
    } else {
        auto* m = new DLManagedTensor{};
        m->manager_ctx = ctx;
        m->deleter = dl_delete_legacy;
        m->dl_tensor = make_dltensor(b, ctx);
        cap = PyCapsule_New(m, "dltensor", capsule_legacy);
        if (!cap) dl_delete_legacy(m);
    }
    if (!cap) throw nb::python_error();
    return nb::steal(cap);
}

nb::object buffer_getitem(nb::handle self, nb::handle key) {
    PyBuffer* b = nb::inst_ptr<PyBuffer>(self);
    b->check_live();
    if (!PySlice_Check(key.ptr())) throw nb::type_error("buffers are sliced with buf[start:stop] (step 1)");
    Py_ssize_t start, stop, step, len;
    if (PySlice_GetIndicesEx(key.ptr(), static_cast<Py_ssize_t>(b->size), &start, &stop, &step, &len) < 0)
        throw nb::python_error();
    if (step != 1) raise_sf("invalid", EINVAL, "buffer slices must be contiguous (step 1)");
    PyBuffer v;
    v.ptr = b->ptr + start;
    v.size = static_cast<size_t>(len);
    v.parent = self.ptr();
    v.parent_c = b;
    v.released = false;
    v.locked = b->locked;
    v.huge = b->huge;
    v.cuda = b->cuda;
    Py_INCREF(self.ptr());
    b->exports++;
    return nb::cast(std::move(v), nb::rv_policy::move);
}

void buffer_release(PyBuffer& b) {
    if (b.released) return;
    if (b.exports > 0)
        raise_sf("in_use", EBUSY,
                 "buffer still has " + std::to_string(b.exports) +
                     " live view(s) (numpy/torch arrays, memoryviews or slices); drop them before release()");
    b.detach();
}

// ---------------------------------------------------------------------------------------------------
// I/O engine

struct PyEngine {
    std::shared_ptr<Engine> engine;
};

struct PyFuture {
    std::shared_ptr<Batch> batch;
    std::vector<Py_buffer> views;

    PyFuture() = default;
    PyFuture(const PyFuture&) = delete;
    PyFuture(PyFuture&& o) noexcept : batch(std::move(o.batch)), views(std::move(o.views)) { o.views.clear(); }
    ~PyFuture() {
        // The kernel may still be writing into these buffers: never let them go before the batch ends. In a
        // forked child the batch runs on in the parent, into the parent's memory: nothing to wait for here.
        if (batch && !views.empty() && !batch->engine->forked()) {
            NoGil nogil;
            batch->wait(-1);
        }
        release_views();
    }
    void release_views() {
        for (auto& v : views) PyBuffer_Release(&v);
        views.clear();
    }
    // In a forked child a batch that had finished is as it was (its buffers were filled before fork); one still
    // running never finishes there: say so rather than wait forever. No lock is taken in the child: a thread
    // of the parent may have held it at fork.
    bool in_child() const { return batch->engine->forked(); }
    void check_process() const {
        if (in_child() && !batch->done.load())
            raise_sf("unavailable", EIO,
                     "this batch was still running in the parent process at fork(); its results stay there");
    }
    bool is_done() {
        if (in_child()) {
            check_process();
            return true;
        }
        std::lock_guard<std::mutex> lk(batch->engine->wait_mu());  // see Batch::finish_one
        return batch->done.load();
    }
};

// Views acquired while parsing a batch; released unless handed to a future.
struct ViewSet {
    std::vector<Py_buffer> views;
    ~ViewSet() {
        for (auto& v : views) PyBuffer_Release(&v);
    }
};

int64_t as_int(PyObject* o, size_t i, const char* field) {
    // Anything with __index__ (numpy integers too), but not bool.
    nb::object idx = PyBool_Check(o) ? nb::object() : nb::steal(PyNumber_Index(o));
    if (!idx.is_valid()) {
        PyErr_Clear();
        raise_sf("invalid", EINVAL, "request " + std::to_string(i) + ": " + field + " must be an integer, not " +
                                        Py_TYPE(o)->tp_name);
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(idx.ptr(), &overflow);
    if (overflow || (v == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        raise_sf("invalid", EINVAL,
                 "request " + std::to_string(i) + ": " + field + " is out of range (" +
                     (overflow < 0 ? "below -2**63" : "at least 2**63") + ")");
    }
    return v;
}

// An integer argument in [lo, hi], else a typed error naming it (instead of nanobind's TypeError).
int64_t int_arg(nb::handle o, const char* what, int64_t lo, int64_t hi) {
    auto bad = [&] {
        raise_sf("invalid", EINVAL, std::string(what) + " must be an integer from " + std::to_string(lo) + " to " +
                                        std::to_string(hi) + ", not " + std::string(nb::repr(o).c_str()));
    };
    nb::object idx = PyBool_Check(o.ptr()) ? nb::object() : nb::steal(PyNumber_Index(o.ptr()));
    if (!idx.is_valid()) {
        PyErr_Clear();
        bad();
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(idx.ptr(), &overflow);
    if (overflow || (v == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        bad();
    }
    if (v < lo || v > hi) bad();
    return v;
}

// A file descriptor argument: an int from 0 to 2**31-1, else a typed EBADF.
int fd_arg(nb::handle o) {
    nb::object idx = PyBool_Check(o.ptr()) ? nb::object() : nb::steal(PyNumber_Index(o.ptr()));
    if (!idx.is_valid()) {
        PyErr_Clear();
        raise_sf("invalid", EINVAL, "fd must be an integer, not " + std::string(Py_TYPE(o.ptr())->tp_name));
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(idx.ptr(), &overflow);
    if (overflow || v < 0 || v > INT32_MAX) {
        PyErr_Clear();
        raise_sf("os", EBADF, "fd " + std::string(nb::repr(o).c_str()) + " is not a file descriptor");
    }
    return static_cast<int>(v);
}

// A timeout in seconds: a number (not NaN); < 0 waits forever.
double timeout_arg(nb::handle o) {
    double t = PyFloat_AsDouble(o.ptr());
    if ((t == -1.0 && PyErr_Occurred()) || PyBool_Check(o.ptr())) {
        PyErr_Clear();
        raise_sf("invalid", EINVAL, "timeout must be a number of seconds, not " + std::string(nb::repr(o).c_str()));
    }
    if (std::isnan(t)) raise_sf("invalid", EINVAL, "timeout must be a number of seconds, not NaN");
    return t;
}

std::string req_name(size_t i, bool write, int fd) {
    return "request " + std::to_string(i) + " (" + (write ? "write" : "read") + ", fd " + std::to_string(fd) + ")";
}

PyFuture engine_submit(PyEngine& self, nb::handle requests, bool bounce, nb::handle checksums) {
    // A tuple of our own: converting a buffer may run Python code (torch, __dlpack__) that changes a list.
    if (PyUnicode_Check(requests.ptr()) || PyBytes_Check(requests.ptr()))
        raise_sf("invalid", EINVAL, "requests must be a sequence of Request tuples, not a string");
    nb::object seq = nb::steal(PySequence_Tuple(requests.ptr()));
    if (!seq.is_valid()) {
        PyErr_Clear();
        raise_sf("invalid", EINVAL, "requests must be a sequence of Request tuples");
    }
    Py_ssize_t n = PyTuple_GET_SIZE(seq.ptr());
    PyObject** items = &PyTuple_GET_ITEM(seq.ptr(), 0);
    nb::object sums;
    PyObject** sum_items = nullptr;
    if (!checksums.is_none()) {
        if (!xxh3_available())
            raise_sf("invalid", EINVAL, "checksums: this build has no xxh3 (libxxhash-dev was missing at build time)");
        if (PyUnicode_Check(checksums.ptr()) || PyBytes_Check(checksums.ptr()))
            raise_sf("invalid", EINVAL, "checksums must be a sequence of int or None, one per request");
        sums = nb::steal(PySequence_Tuple(checksums.ptr()));
        if (!sums.is_valid()) {
            PyErr_Clear();
            raise_sf("invalid", EINVAL, "checksums must be a sequence of int or None, one per request");
        }
        if (PyTuple_GET_SIZE(sums.ptr()) != n)
            raise_sf("invalid", EINVAL, "checksums: " + std::to_string(PyTuple_GET_SIZE(sums.ptr())) +
                                            " given for " + std::to_string(n) + " requests");
        sum_items = n ? &PyTuple_GET_ITEM(sums.ptr(), 0) : nullptr;
    }
    std::vector<RequestSpec> specs;
    specs.reserve(static_cast<size_t>(n));
    ViewSet vs;
    std::unordered_map<PyObject*, size_t> view_of;
    std::unordered_map<int, FdInfo> infos;
    std::vector<nb::object> converted;  // as_buffer() results, alive until their views are taken
    for (Py_ssize_t k = 0; k < n; ++k) {
        size_t i = static_cast<size_t>(k);
        PyObject* item = items[k];
        if (!PyTuple_Check(item) || (PyTuple_GET_SIZE(item) != 5 && PyTuple_GET_SIZE(item) != 6))
            raise_sf("invalid", EINVAL,
                     "request " + std::to_string(i) + ": expected Request(op, fd, offset, length, buffer, buffer_offset)");
        PyObject* opo = PyTuple_GET_ITEM(item, 0);
        // Compared without converting: a str that cannot be UTF-8 (a lone surrogate) is just another wrong op.
        bool write;
        if (PyUnicode_Check(opo) && PyUnicode_CompareWithASCIIString(opo, "read") == 0) write = false;
        else if (PyUnicode_Check(opo) && PyUnicode_CompareWithASCIIString(opo, "write") == 0) write = true;
        else raise_sf("invalid", EINVAL, "request " + std::to_string(i) + ": op must be 'read' or 'write'");
        int64_t fd = as_int(PyTuple_GET_ITEM(item, 1), i, "fd");
        int64_t offset = as_int(PyTuple_GET_ITEM(item, 2), i, "offset");
        int64_t length = as_int(PyTuple_GET_ITEM(item, 3), i, "length");
        PyObject* bufobj = PyTuple_GET_ITEM(item, 4);
        int64_t boff = PyTuple_GET_SIZE(item) == 6 ? as_int(PyTuple_GET_ITEM(item, 5), i, "buffer_offset") : 0;
        auto who = [&] { return req_name(i, write, static_cast<int>(fd)); };  // only on errors: a string per request costs
        if (fd < 0 || fd > INT32_MAX) raise_sf("os", EBADF, who() + ": bad file descriptor");
        if (offset < 0) raise_sf("invalid", EINVAL, who() + ": negative file offset " + std::to_string(offset));
        if (length < 0) raise_sf("invalid", EINVAL, who() + ": negative length " + std::to_string(length));
        if (boff < 0) raise_sf("invalid", EINVAL, who() + ": negative buffer_offset " + std::to_string(boff));
        auto fit = infos.find(static_cast<int>(fd));
        if (fit == infos.end()) {
            try {
                fit = infos.emplace(static_cast<int>(fd), describe_fd(static_cast<int>(fd))).first;
            } catch (const SfError& e) {
                raise_sf("os", e.err, who() + ": " + e.what());
            }
        }
        const FdInfo& fi = fit->second;
        int acc = fi.flags & O_ACCMODE;
        if (write ? acc == O_RDONLY : acc == O_WRONLY)
            raise_sf("os", EBADF, who() + ": descriptor is not open for " + (write ? "writing" : "reading"));
        size_t vi;
        if (auto it = view_of.find(bufobj); it != view_of.end()) {
            vi = it->second;
        } else {
            Py_buffer v;
            if (PyObject_GetBuffer(bufobj, &v, PyBUF_SIMPLE) < 0) {
                PyErr_Clear();
                nb::object conv;
                try {
                    conv = nb::module_::import_("sfstore.buffers").attr("as_buffer")(nb::handle(bufobj));
                } catch (nb::python_error& e) {
                    std::string why = "unusable buffer";
                    try {
                        why += ": " + std::string(nb::str(e.value()).c_str());
                    } catch (...) {  // a message that cannot be shown
                    }
                    raise_sf("invalid", EINVAL, who() + ": " + why);
                }
                if (PyObject_GetBuffer(conv.ptr(), &v, PyBUF_SIMPLE) < 0) {
                    PyErr_Clear();
                    raise_sf("invalid", EINVAL, who() + ": the buffer is not contiguous");
                }
                converted.push_back(conv);
            }
            vs.views.push_back(v);
            vi = vs.views.size() - 1;
            view_of.emplace(bufobj, vi);
        }
        const Py_buffer& v = vs.views[vi];
        if (!write && v.readonly) raise_sf("read_only", 0, who() + ": cannot read into a read-only buffer");
        if (static_cast<uint64_t>(boff) + static_cast<uint64_t>(length) > static_cast<uint64_t>(v.len))
            raise_sf("too_small", 0,
                     who() + ": buffer of " + std::to_string(v.len) + " bytes cannot hold " + std::to_string(length) +
                         " bytes at buffer_offset " + std::to_string(boff));
        char* mem = static_cast<char*>(v.buf) + boff;
        if (fi.direct && !bounce && length > 0 &&
            !(is_aligned(static_cast<uint64_t>(offset), fi.off_align) &&
              is_aligned(static_cast<uint64_t>(length), fi.off_align) &&
              is_aligned(reinterpret_cast<uintptr_t>(mem), fi.mem_align)))
            raise_sf("alignment", EINVAL,
                     who() + ": O_DIRECT needs file offset and length in multiples of " + std::to_string(fi.off_align) +
                         " and memory aligned to " + std::to_string(fi.mem_align) + " (offset " +
                         std::to_string(offset) + ", length " + std::to_string(length) +
                         "); bounce buffers are off (SFSTORE_BOUNCE)");
        RequestSpec spec{write, static_cast<int>(fd), static_cast<uint64_t>(offset), static_cast<uint64_t>(length),
                         mem};
        if (sum_items && sum_items[k] != Py_None) {
            if (write) raise_sf("invalid", EINVAL, who() + ": checksums are checked on reads only");
            if (!PyLong_Check(sum_items[k]) || PyBool_Check(sum_items[k])) raise_sf("invalid", EINVAL, who() + ": a checksum must be an int or None");
            spec.sum = PyLong_AsUnsignedLongLongMask(sum_items[k]);
            spec.verify = true;
        }
        specs.push_back(spec);
    }
    PyFuture fut;
    {
        // An SfError (or bad_alloc) passes through here with the GIL taken back; the translator types it.
        NoGil nogil;
        fut.batch = self.engine->start(std::move(specs), infos);
    }
    fut.views = std::move(vs.views);
    vs.views.clear();
    if (fut.is_done()) fut.release_views();
    return fut;
}

nb::dict engine_stats(PyEngine& self) {
    EngineStats& s = self.engine->stats();
    nb::dict d;
    d["batches"] = s.batches.load();
    d["requests"] = s.requests.load();
    d["bytes_read"] = s.bytes_read.load();
    d["bytes_written"] = s.bytes_written.load();
    d["bytes_direct"] = s.bytes_direct.load();
    d["bytes_bounced"] = s.bytes_bounced.load();
    d["errors"] = s.errors.load();
    d["bytes_verified"] = s.bytes_verified.load();
    d["verify_failed"] = s.verify_failed.load();
    return d;
}

// Buffer views one call holds: `out` (writable) and each source, all C-contiguous, released when the call ends,
// normally or by an error raised on the way (the GIL is held again by then).
struct HeldViews {
    Py_buffer out{};
    bool has_out = false;
    std::vector<Py_buffer> sources;
    HeldViews() = default;
    HeldViews(const HeldViews&) = delete;
    HeldViews& operator=(const HeldViews&) = delete;
    ~HeldViews() {
        for (auto& v : sources) PyBuffer_Release(&v);
        if (has_out) PyBuffer_Release(&out);
    }
};

// `out` as a writable C-contiguous buffer; `what` prefixes the error.
void hold_out(HeldViews& h, nb::handle out, const std::string& what) {
    if (PyObject_GetBuffer(out.ptr(), &h.out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear();
        raise_sf("invalid", EINVAL, what + ": out must be a writable contiguous buffer");
    }
    h.has_out = true;
}

// The length of the sequence `sources`; `what` prefixes the error.
Py_ssize_t sequence_length(nb::handle sources, const std::string& what) {
    Py_ssize_t n = PySequence_Check(sources.ptr()) ? PySequence_Size(sources.ptr()) : -1;
    if (n < 0) {
        PyErr_Clear();
        raise_sf("invalid", EINVAL, what + ": sources must be a sequence");
    }
    return n;
}

// Each item of `sources` as a C-contiguous view holding at least `offset + need` bytes (no size check with
// `need` < 0); `what` prefixes the error.
void hold_sources(HeldViews& h, nb::handle sources, Py_ssize_t n, Py_ssize_t offset, Py_ssize_t need,
                  const std::string& what) {
    h.sources.reserve(static_cast<size_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i) {
        nb::object item = nb::steal(PySequence_GetItem(sources.ptr(), i));
        Py_buffer v;
        if (!item.is_valid() || PyObject_GetBuffer(item.ptr(), &v, PyBUF_C_CONTIGUOUS) < 0) {
            PyErr_Clear();
            raise_sf("invalid", EINVAL, what + ": source " + std::to_string(i) + " is not a contiguous buffer");
        }
        h.sources.push_back(v);
        if (need >= 0 && (v.len < offset || v.len - offset < need))
            raise_sf("invalid", EINVAL, what + ": source " + std::to_string(i) + " holds " + std::to_string(v.len) +
                                            " bytes, fewer than " + std::to_string(offset) + " + " +
                                            std::to_string(need));
    }
}

// A path argument as the bytes the kernel takes: str (undecodable bytes as surrogate escapes, as os.fsdecode
// makes them), bytes or os.PathLike; `what` names it in the error.
std::string fs_path(nb::handle obj, const std::string& what) {
    PyObject* encoded = nullptr;
    if (!PyUnicode_FSConverter(obj.ptr(), &encoded)) {
        PyErr_Clear();
        raise_sf("invalid", EINVAL,
                 what + " must be a str, bytes or os.PathLike without NUL bytes, not " + std::string(nb::repr(obj).c_str()));
    }
    nb::object holder = nb::steal(encoded);
    return std::string(PyBytes_AS_STRING(encoded), static_cast<size_t>(PyBytes_GET_SIZE(encoded)));
}

// Each item of the sequence `paths` as fs_path converts it; `what` names the call in the errors.
std::vector<std::string> path_list(nb::handle paths, const std::string& what) {
    if (!PySequence_Check(paths.ptr())) raise_sf("invalid", EINVAL, what + ": paths must be a list");
    Py_ssize_t n = PySequence_Size(paths.ptr());
    std::vector<std::string> names;
    names.reserve(static_cast<size_t>(n < 0 ? 0 : n));
    for (Py_ssize_t i = 0; i < n; ++i) {
        nb::object item = nb::steal(PySequence_GetItem(paths.ptr(), i));
        if (!item.is_valid()) {
            PyErr_Clear();
            raise_sf("invalid", EINVAL, what + ": paths must be a list");
        }
        names.push_back(fs_path(item, what + ": path " + std::to_string(i)));
    }
    return names;
}

}  // namespace

NB_MODULE(_native, m) {
    m.doc() = "sfstore's native helper (private): registered buffers and the batched O_DIRECT I/O engine.";
    // Buffers still viewed by live tensors at interpreter exit (e.g. a loaded checkpoint held in a global)
    // are not leaks; nanobind would report each one on stderr.
    nb::set_leak_warnings(false);

    nb::register_exception_translator([](const std::exception_ptr& p, void*) {
        try {
            std::rethrow_exception(p);
        } catch (const SfError& e) {
            to_python(e).restore();
        } catch (const std::bad_alloc&) {
            to_python(SfError("resources", ENOMEM, "out of memory in sfstore's native helper")).restore();
        } catch (const std::system_error& e) {
            int err = e.code().value() ? e.code().value() : EAGAIN;
            to_python(SfError("resources", err, std::string("sfstore's native helper: ") + e.what())).restore();
        }
    });

    nb::class_<PyBuffer>(m, "Buffer", nb::type_slots(buffer_slots))
        .def_prop_ro("address", [](PyBuffer& b) { b.check_live(); return reinterpret_cast<uintptr_t>(b.ptr); })
        .def_prop_ro("nbytes", [](PyBuffer& b) { return b.released ? size_t(0) : b.size; })
        .def("__len__", [](PyBuffer& b) { return b.released ? size_t(0) : b.size; })
        .def_prop_ro("locked", [](PyBuffer& b) { return b.locked; })
        .def_prop_ro("huge_pages", [](PyBuffer& b) { return b.huge; })
        .def_prop_ro("cuda_registered", [](PyBuffer& b) { return b.cuda; })
        .def_prop_ro("released", [](PyBuffer& b) { return b.released; })
        .def_prop_ro("exports", [](PyBuffer& b) { return b.exports; })
        .def_prop_ro("is_view", [](PyBuffer& b) { return b.parent != nullptr || (!b.pool && !b.released); })
        .def("release", &buffer_release)
        .def("register_rdma",
             [](nb::handle self, nb::handle pd, nb::object access) {
                 return nb::module_::import_("sfstore.buffers").attr("_register_rdma")(self, pd, access);
             },
             "pd"_a, "access"_a = nb::none())
        .def("__enter__", [](nb::handle self) { return nb::borrow(self); })
        .def("__exit__", [](PyBuffer& b, nb::args) { buffer_release(b); })
        .def("__getitem__", &buffer_getitem)
        .def("__dlpack__", &buffer_dlpack, "stream"_a = nb::none(), nb::kw_only(), "max_version"_a = nb::none(),
             "dl_device"_a = nb::none(), "copy"_a = nb::none())
        .def("__dlpack_device__", [](PyBuffer&) { return std::make_pair(kDLCPU, 0); });

    nb::class_<PyPool>(m, "BufferPool")
        .def("__init__",
             [](PyPool* self, nb::handle buffer_size, nb::handle max_buffers, nb::handle huge, nb::handle lock,
                nb::handle cuda) {
                 auto size = static_cast<size_t>(int_arg(buffer_size, "buffer_size", 1, int64_t(kMaxBufferSize)));
                 auto most = static_cast<size_t>(int_arg(max_buffers, "max_buffers", 0, INT64_MAX));
                 auto mode = [](nb::handle o, const char* what) { return static_cast<Mode>(int_arg(o, what, 0, 2)); };
                 new (self) PyPool{std::make_shared<BufferPool>(size, most, mode(huge, "huge"), mode(lock, "mlock"),
                                                                mode(cuda, "cuda"))};
             },
             "buffer_size"_a, "max_buffers"_a = 0, "huge"_a = 1, "mlock"_a = 1, "cuda"_a = 1)
        .def("acquire",
             [](PyPool& self, nb::handle timeout) {
                 double t = timeout_arg(timeout);
                 Region r;
                 {
                     NoGil nogil;
                     r = self.pool->acquire(t);
                 }
                 PyBuffer b;
                 b.pool = self.pool;
                 b.region = r;
                 b.ptr = r.ptr;
                 b.size = r.size;
                 b.released = false;
                 b.locked = r.locked;
                 b.huge = r.hugetlb || r.thp;
                 b.cuda = r.cuda;
                 return nb::cast(std::move(b), nb::rv_policy::move);
             },
             "timeout"_a = -1.0)
        .def("close", [](PyPool& self) { self.pool->close(); })
        .def("keep_idle",
             [](PyPool& self, nb::object n) {
                 size_t keep = n.is_none() ? SIZE_MAX : static_cast<size_t>(int_arg(n, "n", 0, INT64_MAX));
                 NoGil nogil;  // munmap of many huge buffers takes a while
                 return self.pool->keep_idle(keep);
             },
             "n"_a.none())
        .def_prop_ro("buffer_size", [](PyPool& self) { return self.pool->buffer_size(); })
        .def("stats", [](PyPool& self) {
            PoolStats s = self.pool->stats();
            nb::dict d;
            d["buffer_size"] = s.buffer_size;
            d["max_buffers"] = s.max_buffers;
            d["allocated"] = s.allocated;
            d["in_use"] = s.in_use;
            d["free"] = s.free;
            d["locked_bytes"] = s.locked_bytes;
            d["mlock_failures"] = s.mlock_failures;
            d["mlock_error"] = s.mlock_error;
            d["hugetlb_buffers"] = s.hugetlb_buffers;
            d["thp_buffers"] = s.thp_buffers;
            d["hugetlb_error"] = s.hugetlb_error;
            d["cuda_registered"] = s.cuda_registered;
            d["cuda_error"] = s.cuda_error;
            return d;
        });

    nb::class_<PyFuture>(m, "Future")
        .def("done",
             [](PyFuture& f) {
                 bool d = f.is_done();
                 if (d) f.release_views();
                 return d;
             })
        .def("wait",
             [](PyFuture& f, nb::handle timeout) {
                 double t = timeout_arg(timeout);
                 if (f.in_child()) {
                     f.check_process();
                     f.release_views();
                     return true;
                 }
                 bool d;
                 {
                     NoGil nogil;
                     d = f.batch->wait(t);
                 }
                 if (d) f.release_views();
                 return d;
             },
             "timeout"_a = -1.0)
        .def("transferred",
             [](PyFuture& f) {
                 return std::make_pair(f.batch->moved_direct.load(), f.batch->moved_bounced.load());
             })
        .def("results", [](PyFuture& f) {
            if (f.in_child()) {
                f.check_process();
            } else {
                NoGil nogil;
                f.batch->wait(-1);
            }
            f.release_views();
            return f.batch->results();
        });

    nb::class_<PyEngine>(m, "IOEngine")
        .def("__init__",
             [](PyEngine* self, nb::handle backend, nb::handle queue_depth, nb::handle threads, nb::handle bounce,
                nb::handle spin_us) {
                 std::string name;
                 if (PyUnicode_Check(backend.ptr()) && PyUnicode_CompareWithASCIIString(backend.ptr(), "uring") == 0)
                     name = "uring";
                 else if (PyUnicode_Check(backend.ptr()) &&
                          PyUnicode_CompareWithASCIIString(backend.ptr(), "threads") == 0)
                     name = "threads";
                 else
                     raise_sf("invalid", EINVAL,
                              "backend must be 'uring' or 'threads', not " + std::string(nb::repr(backend).c_str()));
                 auto qd = static_cast<unsigned>(int_arg(queue_depth, "queue_depth", 1, kMaxQueueDepth));
                 auto th = static_cast<unsigned>(int_arg(threads, "threads", 1, kMaxThreads));
                 auto bb = static_cast<size_t>(int_arg(bounce, "bounce_buffer_size", 4096, int64_t(kMaxBounce)));
                 auto spin = static_cast<unsigned>(int_arg(spin_us, "spin_us", 0, kMaxSpinUs));
                 std::shared_ptr<Engine> engine;
                 {
                     NoGil nogil;  // starting threads and setting up a ring can take a while
                     engine = Engine::create(name, qd, th, bb, spin);
                 }
                 new (self) PyEngine{std::move(engine)};
             },
             "backend"_a, "queue_depth"_a, "threads"_a, "bounce_buffer_size"_a, "spin_us"_a = 0)
        .def("submit", &engine_submit, "requests"_a, "bounce"_a = true, "checksums"_a = nb::none())
        .def("stats", &engine_stats)
        .def("close", [](PyEngine& self) {
            NoGil nogil;
            self.engine->close();
        })
        .def_prop_ro("backend", [](PyEngine& self) { return std::string(self.engine->backend_name()); })
        .def_prop_ro("queue_depth", [](PyEngine& self) { return self.engine->depth(); });

    m.def("dio_alignment", [](nb::handle fd) {
        FdInfo fi = describe_fd(fd_arg(fd));
        return std::make_pair(fi.mem_align, fi.off_align);
    }, "fd"_a, "O_DIRECT alignment of an open descriptor: (memory, file offset/length).");
    m.def("fd_is_direct", [](nb::handle fd) { return describe_fd(fd_arg(fd)).direct; }, "fd"_a);
    m.def("uring_status", [] {
        std::string why;
        bool ok;
        {
            NoGil nogil;  // the first call probes on a thread of its own and waits for it
            ok = uring_available(&why);
        }
        return std::make_pair(ok, why);
    });
    m.def("cuda_status", [] {
        std::string why;
        bool ok = cuda::available(&why);
        return std::make_pair(ok, why);
    });
    m.def(
        "bytes_for_filling",
        [](Py_ssize_t n) {
            // An uninitialised bytes object and a writable view of its storage, so a file can be read straight
            // into the bytes a caller gets back (no second copy). Only for a bytes object nobody else has seen:
            // fill it through the view, drop the view, then hand the bytes out.
            if (n < 0) raise_sf("invalid", EINVAL, "bytes_for_filling: n must be >= 0, not " + std::to_string(n));
            PyObject* b = PyBytes_FromStringAndSize(nullptr, n);
            if (!b) {
                PyErr_Clear();
                raise_sf("resources", ENOMEM, "no memory for a bytes object of " + std::to_string(n) + " bytes");
            }
            nb::object bytes = nb::steal(b);
            PyObject* mv = PyMemoryView_FromMemory(PyBytes_AS_STRING(b), n, PyBUF_WRITE);
            if (!mv) throw nb::python_error();
            return nb::make_tuple(bytes, nb::steal(mv));
        },
        "n"_a);
    m.def(
        "open_beneath",
        [](int dirfd, nb::handle path_obj, int flags, unsigned mode) {
            const std::string path = fs_path(path_obj, "open_beneath: path");
            int fd;
            {
                NoGil nogil;
                fd = openat2_beneath(dirfd, path.c_str(), flags, mode);
            }
            if (fd < 0) {
                errno = -fd;
                PyErr_SetFromErrnoWithFilename(PyExc_OSError, path.c_str());
                throw nb::python_error();
            }
            return fd;
        },
        "dirfd"_a, "path"_a, "flags"_a, "mode"_a = 0644);
    m.def(
        "open_files_beneath",
        [](int dirfd, nb::handle paths, int flags, int64_t size, bool direct) {
            // Many open_beneath calls in one, for a batch of reads (beneath.hpp). Per path: (fd, errno, st_mode,
            // st_dev, st_ino, st_size, st_atime_ns, st_mtime_ns).
            std::vector<std::string> names = path_list(paths, "open_files_beneath");
            std::vector<OpenedFile> got;
            {
                NoGil nogil;
                got = open_files_beneath(dirfd, names, flags, size, direct);
            }
            nb::list out;
            for (const OpenedFile& g : got) {
                auto ns = [](const struct timespec& t) { return static_cast<int64_t>(t.tv_sec) * 1000000000LL + t.tv_nsec; };
                out.append(nb::make_tuple(g.fd, g.err, static_cast<int64_t>(g.st.st_mode),
                                          static_cast<uint64_t>(g.st.st_dev), static_cast<uint64_t>(g.st.st_ino),
                                          static_cast<int64_t>(g.st.st_size), ns(g.st.st_atim), ns(g.st.st_mtim)));
            }
            return out;
        },
        "dirfd"_a, "paths"_a, "flags"_a, "size"_a, "direct"_a);
    m.def(
        "stat_files_beneath",
        [](int dirfd, nb::handle paths, int flags, bool leading) {
            // Whether each path is there, for a batch of lookups (beneath.hpp): its st_mode or -errno.
            std::vector<std::string> names = path_list(paths, "stat_files_beneath");
            std::vector<int64_t> modes;
            {
                NoGil nogil;
                modes = stat_files_beneath(dirfd, names, flags, leading);
            }
            nb::list out;
            for (int64_t m : modes) out.append(m);
            return out;
        },
        "dirfd"_a, "paths"_a, "flags"_a, "leading"_a = false);
    m.def("xxh3_available", [] { return xxh3_available(); },
          "Whether reads can be checked against xxh3-64 checksums in the engine (built with xxhash.h).");
    m.def(
        "xxh3_64",
        [](nb::handle data) {
            if (!xxh3_available()) raise_sf("invalid", EINVAL, "this build has no xxh3");
            Py_buffer v;
            if (PyObject_GetBuffer(data.ptr(), &v, PyBUF_SIMPLE) < 0) {
                PyErr_Clear();
                raise_sf("invalid", EINVAL, "xxh3_64 needs a contiguous buffer (bytes, memoryview, array)");
            }
            uint64_t h;
            if (v.len >= (64 << 10)) {
                // The view pins the memory (no resize while exported): other Python threads may run meanwhile.
                NoGil nogil;
                h = xxh3_64(v.buf, static_cast<size_t>(v.len));
            } else {
                h = xxh3_64(v.buf, static_cast<size_t>(v.len));
            }
            PyBuffer_Release(&v);
            return h;
        },
        "data"_a, "xxh3-64 (seed 0) of a contiguous buffer, as the engine checks reads; releases the GIL for "
                  "64 KiB and more.");
    m.def(
        "xxh3_64_many",
        [](nb::handle sources) {
            // One release of the GIL for a batch's checksums (a batch of KV blocks read together), not one per
            // buffer: each release and retake is a hand-over that a busy main thread pays for.
            if (!xxh3_available()) raise_sf("invalid", EINVAL, "this build has no xxh3");
            Py_ssize_t n = sequence_length(sources, "xxh3_64_many");
            HeldViews h;
            hold_sources(h, sources, n, 0, -1, "xxh3_64_many");
            std::vector<uint64_t> sums(static_cast<size_t>(n));
            {
                NoGil nogil;  // every view is held (no resize while exported) until the call ends
                for (size_t i = 0; i < sums.size(); ++i)
                    sums[i] = xxh3_64(h.sources[i].buf, static_cast<size_t>(h.sources[i].len));
            }
            nb::list out;
            for (uint64_t v : sums) out.append(v);
            return out;
        },
        "sources"_a, "xxh3-64 (seed 0) of each contiguous buffer in ``sources``, with the GIL released once.");
    m.def(
        "gather",
        [](nb::handle out, nb::handle sources, Py_ssize_t offset, Py_ssize_t nbytes) {
            // One call for what would be one Python-level copy per source (layer_copy.hpp), the GIL released
            // around the copies (every view is held until they are done).
            if (offset < 0 || nbytes < 0) raise_sf("invalid", EINVAL, "gather: offset and nbytes must be >= 0");
            Py_ssize_t n = sequence_length(sources, "gather");
            HeldViews h;
            hold_out(h, out, "gather");
            if (nbytes > 0 && n > (h.out.len / nbytes))
                raise_sf("invalid", EINVAL, "gather: out holds " + std::to_string(h.out.len) + " bytes, not " +
                                                std::to_string(n) + " x " + std::to_string(nbytes));
            hold_sources(h, sources, n, offset, nbytes, "gather");
            std::vector<const char*> srcs;
            for (const Py_buffer& v : h.sources) srcs.push_back(static_cast<const char*>(v.buf));
            {
                NoGil nogil;
                gather_rows(static_cast<char*>(h.out.buf), srcs, static_cast<size_t>(offset), static_cast<size_t>(nbytes));
            }
        },
        "out"_a, "sources"_a, "offset"_a, "nbytes"_a,
        "Copy bytes [offset, offset + nbytes) of each source buffer into consecutive rows of out (GIL released).");
    m.def(
        "scatter",
        [](nb::handle out, nb::handle sources, Py_ssize_t offset, std::vector<Py_ssize_t> out_offsets,
           std::vector<Py_ssize_t> counts, std::vector<Py_ssize_t> out_strides, std::vector<Py_ssize_t> src_strides,
           Py_ssize_t run) {
            // A layer of many blocks straight into strided pages (layer_copy.hpp); every extent is checked before
            // any byte moves.
            auto bad = [](const std::string& msg) { raise_sf("invalid", EINVAL, "scatter: " + msg); };
            if (offset < 0) bad("offset and run must be >= 0");
            Py_ssize_t out_extent = 0, src_extent = 0;
            bool empty = true;
            std::string why = scatter_extents(run, counts, out_strides, src_strides, &out_extent, &src_extent, &empty);
            if (!why.empty()) bad(why);
            Py_ssize_t n = sequence_length(sources, "scatter");
            if (static_cast<size_t>(n) != out_offsets.size())
                bad(std::to_string(n) + " sources but " + std::to_string(out_offsets.size()) + " out_offsets");
            HeldViews h;
            hold_out(h, out, "scatter");
            for (Py_ssize_t i = 0; i < n && !empty; ++i) {
                Py_ssize_t at = out_offsets[static_cast<size_t>(i)];
                if (at < 0 || at > h.out.len || h.out.len - at < out_extent)
                    bad("out_offsets[" + std::to_string(i) + "] = " + std::to_string(at) + " with an extent of " +
                        std::to_string(out_extent) + " bytes leaves out (" + std::to_string(h.out.len) + " bytes)");
            }
            hold_sources(h, sources, n, offset, empty ? -1 : src_extent, "scatter");
            if (!empty) {
                std::vector<const char*> srcs;
                for (const Py_buffer& v : h.sources) srcs.push_back(static_cast<const char*>(v.buf) + offset);
                NoGil nogil;
                scatter_rows(static_cast<char*>(h.out.buf), srcs, out_offsets, counts, out_strides, src_strides,
                             static_cast<size_t>(run));
            }
        },
        "out"_a, "sources"_a, "offset"_a, "out_offsets"_a, "counts"_a, "out_strides"_a, "src_strides"_a, "run"_a,
        "Copy a 3-D grid of runs of each source buffer into out at its offset (GIL released; extents checked).");
    m.def("page_size", [] { return static_cast<size_t>(sysconf(_SC_PAGESIZE)); });
}
