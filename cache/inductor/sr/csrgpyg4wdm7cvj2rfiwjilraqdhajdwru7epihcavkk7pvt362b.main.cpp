
#include <torch/csrc/inductor/cpp_prefix.h>
extern "C"  void  kernel(const int32_t* in_ptr0,
                       int64_t* out_ptr0,
                       bool* out_ptr1,
                       const int64_t ks0,
                       const int64_t ks1,
                       const int64_t ks2,
                       const int64_t ks3,
                       const int64_t ks4,
                       const int64_t ks5)
{
    std::atomic<int> inductor_cpu_integer_div_error{0};
    inductor_cpu_integer_div_error_flag = &inductor_cpu_integer_div_error;
    #pragma omp parallel
    {
        int tid = omp_get_thread_num();
        {
            #pragma omp for
            for(int64_t x0=static_cast<int64_t>(0L); x0<static_cast<int64_t>(ks0); x0+=static_cast<int64_t>(8L))
            {
                {
                    if(C10_LIKELY(x0 >= static_cast<int64_t>(0) && x0 < static_cast<int64_t>(8L*(c10::div_floor_integer(static_cast<int64_t>(ks0), static_cast<int64_t>(8L))))))
                    {
                        auto tmp0 = at::vec::Vectorized<int32_t>::loadu(in_ptr0 + static_cast<int64_t>(x0), static_cast<int64_t>(8));
                        auto tmp1 = ks1;
                        auto tmp2 = c10::convert<int32_t>(tmp1);
                        auto tmp3 = at::vec::Vectorized<int32_t>(tmp2);
                        auto tmp4 = at::vec::VecMask<int32_t,1>(tmp0 >= tmp3);
                        auto tmp5 = ks2;
                        auto tmp6 = c10::convert<int32_t>(tmp5);
                        auto tmp7 = at::vec::Vectorized<int32_t>(tmp6);
                        auto tmp8 = at::vec::VecMask<int32_t,1>(tmp0 < tmp7);
                        auto tmp9 = tmp4.template cast<int32_t,1>();
                        auto tmp10 = tmp8.template cast<int32_t,1>();
                        auto tmp11 = tmp9 & tmp10;
                        auto tmp12 = ks3;
                        auto tmp13 = c10::convert<int32_t>(tmp12);
                        auto tmp14 = at::vec::Vectorized<int32_t>(tmp13);
                        auto tmp15 = at::vec::VecMask<int32_t,1>(tmp0 >= tmp14);
                        auto tmp16 = ks4;
                        auto tmp17 = c10::convert<int32_t>(tmp16);
                        auto tmp18 = at::vec::Vectorized<int32_t>(tmp17);
                        auto tmp19 = at::vec::VecMask<int32_t,1>(tmp0 < tmp18);
                        auto tmp20 = tmp15.template cast<int32_t,1>();
                        auto tmp21 = tmp19.template cast<int32_t,1>();
                        auto tmp22 = tmp20 & tmp21;
                        auto tmp23 = tmp11.template cast<int32_t,1>();
                        auto tmp24 = tmp22.template cast<int32_t,1>();
                        auto tmp25 = tmp23 | tmp24;
                        auto tmp26 = tmp25.to<int64_t,2>();
                        auto tmp27 = at::vec::convert<int64_t,2,int32_t,1>(tmp0);
                        auto tmp28 = tmp11.to<int64_t,2>();
                        auto tmp29 = c10::convert<int64_t>(tmp1);
                        auto tmp30 = at::vec::VectorizedN<int64_t,2>(tmp29);
                        auto tmp31 = tmp28 * tmp30;
                        auto tmp32 = tmp22.to<int64_t,2>();
                        auto tmp33 = ks1 + ks3 + ((-1L)*ks2) + ((-1L)*ks5);
                        auto tmp34 = c10::convert<int64_t>(tmp33);
                        auto tmp35 = at::vec::VectorizedN<int64_t,2>(tmp34);
                        auto tmp36 = tmp32 * tmp35;
                        auto tmp37 = tmp31 + tmp36;
                        auto tmp38 = tmp27 - tmp37;
                        auto tmp39 = tmp26 * tmp38;
                        auto tmp40 = ~tmp25;
                        tmp39.store(out_ptr0 + static_cast<int64_t>(x0), static_cast<int64_t>(8));
                        tmp40.store(out_ptr1 + static_cast<int64_t>(x0), static_cast<int64_t>(8));
                    }
                    if(C10_UNLIKELY(x0 >= static_cast<int64_t>(8L*(c10::div_floor_integer(static_cast<int64_t>(ks0), static_cast<int64_t>(8L)))) && x0 < static_cast<int64_t>(ks0)))
                    {
                        auto tmp0 = at::vec::Vectorized<int32_t>::loadu(in_ptr0 + static_cast<int64_t>(x0), static_cast<int64_t>(ks0 + (-8L)*(c10::div_floor_integer(static_cast<int64_t>(ks0), static_cast<int64_t>(8L)))));
                        auto tmp1 = ks1;
                        auto tmp2 = c10::convert<int32_t>(tmp1);
                        auto tmp3 = at::vec::Vectorized<int32_t>(tmp2);
                        auto tmp4 = at::vec::VecMask<int32_t,1>(tmp0 >= tmp3);
                        auto tmp5 = ks2;
                        auto tmp6 = c10::convert<int32_t>(tmp5);
                        auto tmp7 = at::vec::Vectorized<int32_t>(tmp6);
                        auto tmp8 = at::vec::VecMask<int32_t,1>(tmp0 < tmp7);
                        auto tmp9 = tmp4.template cast<int32_t,1>();
                        auto tmp10 = tmp8.template cast<int32_t,1>();
                        auto tmp11 = tmp9 & tmp10;
                        auto tmp12 = ks3;
                        auto tmp13 = c10::convert<int32_t>(tmp12);
                        auto tmp14 = at::vec::Vectorized<int32_t>(tmp13);
                        auto tmp15 = at::vec::VecMask<int32_t,1>(tmp0 >= tmp14);
                        auto tmp16 = ks4;
                        auto tmp17 = c10::convert<int32_t>(tmp16);
                        auto tmp18 = at::vec::Vectorized<int32_t>(tmp17);
                        auto tmp19 = at::vec::VecMask<int32_t,1>(tmp0 < tmp18);
                        auto tmp20 = tmp15.template cast<int32_t,1>();
                        auto tmp21 = tmp19.template cast<int32_t,1>();
                        auto tmp22 = tmp20 & tmp21;
                        auto tmp23 = tmp11.template cast<int32_t,1>();
                        auto tmp24 = tmp22.template cast<int32_t,1>();
                        auto tmp25 = tmp23 | tmp24;
                        auto tmp26 = tmp25.to<int64_t,2>();
                        auto tmp27 = at::vec::convert<int64_t,2,int32_t,1>(tmp0);
                        auto tmp28 = tmp11.to<int64_t,2>();
                        auto tmp29 = c10::convert<int64_t>(tmp1);
                        auto tmp30 = at::vec::VectorizedN<int64_t,2>(tmp29);
                        auto tmp31 = tmp28 * tmp30;
                        auto tmp32 = tmp22.to<int64_t,2>();
                        auto tmp33 = ks1 + ks3 + ((-1L)*ks2) + ((-1L)*ks5);
                        auto tmp34 = c10::convert<int64_t>(tmp33);
                        auto tmp35 = at::vec::VectorizedN<int64_t,2>(tmp34);
                        auto tmp36 = tmp32 * tmp35;
                        auto tmp37 = tmp31 + tmp36;
                        auto tmp38 = tmp27 - tmp37;
                        auto tmp39 = tmp26 * tmp38;
                        auto tmp40 = ~tmp25;
                        tmp39.store(out_ptr0 + static_cast<int64_t>(x0), static_cast<int64_t>(ks0 + (-8L)*(c10::div_floor_integer(static_cast<int64_t>(ks0), static_cast<int64_t>(8L)))));
                        tmp40.store(out_ptr1 + static_cast<int64_t>(x0), static_cast<int64_t>(ks0 + (-8L)*(c10::div_floor_integer(static_cast<int64_t>(ks0), static_cast<int64_t>(8L)))));
                    }
                }
            }
        }
    }
    inductor_cpu_integer_div_error_flag = nullptr;
    inductor_cpu_throw_if_integer_div_error(inductor_cpu_integer_div_error);
}

// Python bindings to call kernel():
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <sstream>
#include <cstdlib>
#include <cerrno>

// This is defined in guards.cpp so we don't need to import PyTorch headers that are slooow.
// We manually link it below to workaround issues with fbcode build.
static void* (*_torchinductor_pyobject_tensor_data_ptr)(PyObject* obj);

template <typename T> static inline T parse_arg(PyObject* args, size_t n) {
    static_assert(std::is_pointer_v<T>, "arg type must be pointer or long");
    return static_cast<T>(_torchinductor_pyobject_tensor_data_ptr(PyTuple_GET_ITEM(args, n)));
}
template <> inline int64_t parse_arg<int64_t>(PyObject* args, size_t n) {
    auto result = PyLong_AsSsize_t(PyTuple_GET_ITEM(args, n));
    if(result == -1 && PyErr_Occurred()) [[unlikely]]
        throw std::runtime_error("expected int arg");
    return result;
}
template <> inline uintptr_t parse_arg<uintptr_t>(PyObject* args, size_t n) {
    auto result = PyLong_AsVoidPtr(PyTuple_GET_ITEM(args, n));
    if(result == reinterpret_cast<void*>(-1) && PyErr_Occurred()) [[unlikely]]
        throw std::runtime_error("expected int arg");
    return reinterpret_cast<uintptr_t>(result);
}
template <> inline float parse_arg<float>(PyObject* args, size_t n) {
    auto result = PyFloat_AsDouble(PyTuple_GET_ITEM(args, n));
    if(result == -1.0 && PyErr_Occurred()) [[unlikely]]
        throw std::runtime_error("expected float arg");
    return static_cast<float>(result);
}



static PyObject* kernel_py(PyObject* self, PyObject* args) {
    try {
        if(!PyTuple_CheckExact(args)) [[unlikely]]
            throw std::runtime_error("tuple args required");
        if(PyTuple_GET_SIZE(args) != 9) [[unlikely]]
            throw std::runtime_error("requires 9 args");
        kernel(parse_arg<int32_t*>(args, 0), parse_arg<int64_t*>(args, 1), parse_arg<bool*>(args, 2), parse_arg<int64_t>(args, 3), parse_arg<int64_t>(args, 4), parse_arg<int64_t>(args, 5), parse_arg<int64_t>(args, 6), parse_arg<int64_t>(args, 7), parse_arg<int64_t>(args, 8)); Py_RETURN_NONE;
    } catch(std::exception const& e) {
        PyErr_SetString(PyExc_RuntimeError, e.what());
        return nullptr;
    } catch(...) {
        PyErr_SetString(PyExc_RuntimeError, "unhandled error");
        return nullptr;
    }
}

static PyMethodDef py_methods[] = {
    {"kernel", kernel_py, METH_VARARGS, ""},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef py_module =
    {PyModuleDef_HEAD_INIT, "kernel", NULL, -1, py_methods};

PyMODINIT_FUNC PyInit_kernel(void) {
    const char* str_addr = std::getenv("_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR");
    if(!str_addr) {
        PyErr_SetString(PyExc_RuntimeError, "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR must be set");
        return nullptr;
    }

    char* endptr = nullptr;
    errno = 0;
    uintptr_t addr = std::strtoull(str_addr, &endptr, 10);
    if(errno != 0 || endptr == str_addr || addr == 0) {
        PyErr_SetString(PyExc_RuntimeError, "Failed to parse _TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR");
        return nullptr;
    }
    _torchinductor_pyobject_tensor_data_ptr =
        reinterpret_cast<decltype(_torchinductor_pyobject_tensor_data_ptr)>(addr);
    PyObject* module = PyModule_Create(&py_module);
    if (module == NULL) {
        return NULL;
    }
    #ifdef Py_GIL_DISABLED
        PyUnstable_Module_SetGIL(module, Py_MOD_GIL_NOT_USED);
    #endif
    return module;
}
